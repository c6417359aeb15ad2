"""Inputs as real models hand them over: strided views, garbage in masked positions, NaN that
must show, learnable biases, torch.func, double backward, threads, and bad arguments.

Every expectation is the independent float64 math of ``conftest.naive_attention`` (or the
contiguous copy of the same call), never attnkit's own reference.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
import torch.utils._python_dispatch

import attnkit as ak
from attnkit import dispatch, finite
from attnkit.backends import tiled
from attnkit.inputs import validate
from attnkit.masks import UNBOUNDED, MaskCache, MaskSpace

from conftest import naive_attention

CPU_BACKENDS = ["reference", "tiled", "torch", "auto"]
NAN, INF = float("nan"), float("inf")


def _grads(backend, q, k, v, mask, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = ak.attention(*leaves, mask, backend=backend, **kw)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


# ---- any strided input ---------------------------------------------------------------------

def _layouts(gen):
    """(name, q, k, v) views of one logical [2, 4, 24, 16] call, each in another layout."""
    fused = torch.randn(2, 4, 24, 16, 3, generator=gen)
    bthd = torch.randn(3, 2, 24, 4, 16, generator=gen)
    wide = torch.randn(3, 2, 4, 24, 32, generator=gen)
    one = torch.randn(3, 1, 1, 24, 16, generator=gen)
    yield "unbind (last stride 3)", *fused.unbind(-1)
    yield "transposed [B, T, H, D]", *(t.transpose(1, 2) for t in bthd)
    yield "every other feature", *(t[..., ::2] for t in wide)
    yield "expanded batch and heads", *(t.expand(2, 4, 24, 16) for t in one)
    yield "sliced rows", *(t[:, :, 3:27] for t in torch.randn(3, 2, 4, 30, 16, generator=gen))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mask", [None, ak.causal(), ak.sliding_window(5, 2),
                                  ak.padding(kv_lengths=[20, 9])], ids=repr)
def test_strided_inputs_equal_their_contiguous_copy(backend, mask, gen):
    for name, q, k, v in _layouts(gen):
        assert q.stride() != q.contiguous().stride() or k.stride() != k.contiguous().stride()
        out, grads = _grads(backend, q, k, v, mask)
        want, want_grads = _grads(backend, *(t.contiguous() for t in (q, k, v)), mask)
        torch.testing.assert_close(out, want, msg=name)
        for got, expected in zip(grads, want_grads):
            torch.testing.assert_close(got, expected, msg=name)


@pytest.mark.parametrize("layout", ["[T, B, H, D]", "[H, B, T, D]", "[B, T, H, D]"])
@pytest.mark.parametrize("mask", [ak.documents(torch.arange(512) // 256),
                                  ak.documents(torch.arange(512) // 128, causal="top_left")],
                         ids=["documents", "causal documents"])
def test_layouts_where_the_tiled_engine_runs_alike_blocks_at_once(layout, mask, gen):
    """Equal documents let the tiled engine run alike query blocks as one batch of views over
    B·H (runs): a sequence-first q (``nn.MultiheadAttention(batch_first=False)``'s) and others
    give their contiguous copy's result, forward and backward."""
    order = {"[T, B, H, D]": (2, 0, 1, 3), "[H, B, T, D]": (1, 0, 2, 3),
             "[B, T, H, D]": (0, 2, 1, 3)}[layout]
    stored = [torch.randn(*(2 if d < 2 else 512 if d == 2 else 8 for d in order),
                          generator=gen) for _ in range(3)]
    q, k, v = (t.permute(*sorted(range(4), key=order.__getitem__)) for t in stored)
    assert q.shape == (2, 2, 512, 8) and not q.is_contiguous()
    out, grads = _grads("tiled", q, k, v, mask)
    want, want_grads = _grads("reference", *(t.double().contiguous() for t in (q, k, v)), mask)
    torch.testing.assert_close(out, want.float(), atol=1e-5, rtol=1e-5)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected.float(), atol=1e-4, rtol=1e-4)


def test_strided_inputs_are_copied_only_where_the_feature_dim_is_strided(gen):
    from attnkit.inputs import validate
    q, k, v = torch.randn(2, 4, 24, 16, 3, generator=gen).unbind(-1)
    t = torch.randn(2, 24, 4, 16, generator=gen).transpose(1, 2)
    inputs = validate(q, t, t)
    assert inputs.q.stride(-1) == 1 and inputs.k.data_ptr() == t.data_ptr()


# ---- masked positions cannot leak; allowed ones propagate -----------------------------------

def _poisoned(gen, value):
    q, k, v = torch.randn(3, 2, 2, 40, 8, dtype=torch.float64, generator=gen).unbind(0)
    k, v = k.clone(), v.clone()
    k[:, :, 30:] = value  # past kv_lengths: excluded for every query
    v[:, :, 30:] = value
    k[0, 1, 12, 3] = value  # key 12: excluded by causal for queries 0..11
    v[1, 0, 12, 5] = value
    return q, k, v


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_garbage_outside_the_real_keys_is_never_read(backend, value, gen):
    """Past kv_lengths (keys 30..) every head holds poison, which never reaches a result or a
    gradient; key 12, a real key, is poisoned in two heads, whose rows that attend it
    (12..) are NaN, never a wrong finite number."""
    q, k, v = _poisoned(gen, value)
    mask = ak.causal() & ak.padding(kv_lengths=[30, 30])
    idx = torch.arange(40)
    allowed = (idx[None, :] <= idx[:, None]) & (idx[None, :] < 30)  # [Tq, Tk]
    out, (dq, dk, dv) = _grads(backend, q, k, v, mask)
    r = ak.attention(q, k, v, mask, backend=backend, return_lse=True) if backend != "torch" else None
    # Rows 12.. see the poisoned key 12 of (batch 0, head 1) / (batch 1, head 0) in k or v.
    assert not torch.isfinite(out[0, 1, 12:]).any() and not torch.isfinite(out[1, 0, 12:]).any()
    truth = naive_attention(q, k.nan_to_num(0.0, 0.0, 0.0), v.nan_to_num(0.0, 0.0, 0.0), allowed)
    for b, h in ((0, 0), (1, 1)):  # heads whose only poison lies past the real keys: exact
        torch.testing.assert_close(out[b, h], truth[0][b, h])
        if r is not None:
            torch.testing.assert_close(r.lse[b, h], truth[1][b, h])
        for grad in (dq, dk, dv):
            assert torch.isfinite(grad[b, h]).all()
        assert (dk[b, h, 30:] == 0).all() and (dv[b, h, 30:] == 0).all()
    for b, h in ((0, 1), (1, 0)):  # rows before the poisoned real key: exact, or NaN
        rows = out[b, h, :12]
        assert (torch.isnan(rows) | torch.isclose(rows, truth[0][b, h, :12])).all()


@pytest.mark.parametrize("form", ["kv_mask", "kv_starts"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("queries", [1, 3])
def test_a_step_over_a_key_padding_reads_each_sequence_alone(queries, dtype, form, gen):
    """A decoding step (few queries, a large cache) over a padding of its keys alone (read
    from transformers' 2-D mask, or given by starts and lengths; left padding, a sequence
    without keys) runs on torch per sequence over its real keys: no copy of K/V, NaN outside
    them never read; out, LSE and gradients equal the float64 math, with zero gradients
    outside the real keys."""
    starts = torch.tensor([0, 37, 301, 600])
    q = torch.randn(4, 8, queries, 64, generator=gen, dtype=dtype)
    k, v = (torch.randn(4, 2, 600, 64, generator=gen, dtype=dtype) for _ in range(2))
    real = torch.arange(600) >= starts[:, None]  # [B, Tk]; the last row has no real key
    poison = ~real[:, None, :, None]
    dirty = [t.masked_fill(poison, NAN) for t in (k, v)]
    mask = (ak.masks.real_keys(real) if form == "kv_mask" else
            ak.padding(kv_starts=starts, kv_lengths=600 - starts, allow_empty_rows=True))
    inputs = validate(q, *dirty, mask, need_lse=True)
    assert not dispatch.BACKENDS["torch"].reads_padding(inputs)  # the per-sequence path
    copies = _CopiesOf(k.numel())
    with copies:
        r = ak.attention(q, *dirty, mask, backend="torch", return_lse=True)
    assert copies.count == 0
    out, (dq, dk, dv) = _grads("torch", q, *dirty, mask)
    allowed = real[:, None, None, :]
    want, lse, _ = naive_attention(q, k.masked_fill(poison, 0), v.masked_fill(poison, 0),
                                   allowed)
    torch.testing.assert_close(r.out, want.to(dtype))
    torch.testing.assert_close(out, want.to(dtype))
    torch.testing.assert_close(r.lse, lse.to(r.lse.dtype))
    leaves = [t.double().requires_grad_() for t in (q, k.masked_fill(poison, 0),
                                                    v.masked_fill(poison, 0))]
    ref = ak.attention(*leaves, mask, backend="reference")
    ref.backward(torch.linspace(-1, 1, ref.numel()).reshape(ref.shape).double())
    for got, leaf in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(got, leaf.grad.to(dtype))
    assert (dk.masked_select(poison) == 0).all() and (dv.masked_select(poison) == 0).all()


@pytest.mark.parametrize("seed", range(12))
def test_random_steps_over_a_key_padding_equal_the_math(seed):
    """Random batches (1..5 sequences, GQA 1..4, 1..16 queries, Dv ≠ Dk, right or left or both
    padding, empty sequences, NaN outside the keys) through the per-sequence path: out, LSE
    and gradients as the float64 reference over zeros there."""
    rng = torch.Generator().manual_seed(seed)

    def pick(*options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    batch, heads_kv, group = pick(1, 2, 5), pick(1, 2, 4), pick(1, 3, 4)
    queries, dim, dim_v = pick(1, 4, 16), pick(16, 64), pick(24, 64)
    width = (1 << 16) // (heads_kv * dim) + int(torch.randint(300, (1,), generator=rng))
    dtype = pick(torch.float32, torch.float64)
    q = torch.randn(batch, heads_kv * group, queries, dim, generator=rng, dtype=dtype)
    k = torch.randn(batch, heads_kv, width, dim, generator=rng, dtype=dtype)
    v = torch.randn(batch, heads_kv, width, dim_v, generator=rng, dtype=dtype)
    starts = torch.randint(width + 1, (batch,), generator=rng) * pick(0, 1)
    lengths = (torch.rand(batch, generator=rng) * (width - starts + 1)).long()
    positions = torch.arange(width)
    real = (positions >= starts[:, None]) & (positions < (starts + lengths)[:, None])
    mask = pick(ak.padding(kv_lengths=lengths, kv_starts=starts, allow_empty_rows=True),
                ak.masks.real_keys(real))
    poison = ~real[:, None, :, None]
    leaves = [q.clone().requires_grad_(),
              *(t.masked_fill(poison, NAN).requires_grad_() for t in (k, v))]
    out = ak.attention(*leaves, mask, backend="torch")
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(dtype))
    clean = [t.double().requires_grad_() for t in (q, k.masked_fill(poison, 0),
                                                   v.masked_fill(poison, 0))]
    want = ak.attention(*clean, mask, backend="reference", return_lse=True)
    want.out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape).double())
    torch.testing.assert_close(out, want.out.to(dtype))
    for got, ref in zip(leaves, clean):
        torch.testing.assert_close(got.grad, ref.grad.to(dtype))
    if dim_v == dim:
        with torch.no_grad():
            lse = ak.attention(*(t.detach() for t in leaves), mask, backend="torch",
                               return_lse=True).lse
        torch.testing.assert_close(lse, want.lse.to(lse.dtype))


class _CopiesOf(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operations whose output holds ``numel`` elements (a copy of K or V)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() == self.numel and func not in (
                torch.ops.aten.view.default, torch.ops.aten.slice.Tensor,
                torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            self.count += 1
        return out


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mask", [None, ak.causal()], ids=repr)
def test_nan_in_q_propagates(backend, mask, gen):
    q, k, v = torch.randn(3, 2, 2, 16, 8, generator=gen).unbind(0)
    q = q.clone()
    q[0, 1, 5, 2] = NAN
    kw = dict(return_lse=True) if backend != "torch" else {}
    r = ak.attention(q, k, v, mask, backend=backend, **kw)
    out = r.out if kw else r
    assert torch.isnan(out[0, 1, 5]).all()
    assert torch.isfinite(out[0, 1, :5]).all() and torch.isfinite(out[1]).all()
    if kw:
        assert torch.isnan(r.lse[0, 1, 5]) and torch.isfinite(r.lse[1]).all()



@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("place", ["first", "last"])
@pytest.mark.parametrize("q_len", [3, 64])  # the keys looked at because K is small / rows many
def test_inf_anywhere_in_the_keys_reaches_every_row_of_its_group(backend, place, q_len, gen):
    """An ±inf in one element of K (its first or its last, whose score is −inf for some rows:
    torch's kernel drops those as a masked key) makes every query row of that K/V head's
    group NaN, and leaves every other row exact."""
    q = torch.randn(2, 4, q_len, 8, generator=gen)
    k, v = torch.randn(2, 2, 2, 40, 8, generator=gen).unbind(0)
    bad = k.clone()
    where = (1, 0, 0, 0) if place == "first" else (1, 0, 39, 7)
    bad[where] = -INF if place == "first" else INF
    out = ak.attention(q, bad, v, backend=backend)
    assert torch.isnan(out[1, :2]).all()  # the query heads of K/V head 0 in batch element 1
    others = torch.ones(2, 4, dtype=torch.bool)
    others[1, :2] = False
    clean = ak.attention(q, k, v, backend=backend)
    torch.testing.assert_close(out[others], clean[others], rtol=0, atol=0)

@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_nan_in_q_of_a_fully_masked_row_stays_zero(backend, gen):
    q, k, v = torch.randn(3, 2, 1, 6, 8, generator=gen).unbind(0)
    q = q.clone()
    q[0, 0, 4] = NAN  # padded query: no allowed key
    out = ak.attention(q, k, v, ak.padding(q_lengths=[3, 6]), backend=backend)
    assert (out[0, 0, 3:] == 0).all() and torch.isfinite(out).all()


def test_a_poisoned_row_sends_nan_gradients_back(gen):
    q, k, v = torch.randn(3, 1, 1, 8, 4, dtype=torch.float64, generator=gen).unbind(0)
    v = v.clone()
    v[0, 0, 2] = NAN
    q.requires_grad_()
    ak.attention(q, k, v, ak.causal(), backend="tiled").sum().backward()
    assert torch.isnan(q.grad[0, 0, 2:]).all()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("where", ["key", "value"])
def test_a_poisoned_row_sends_nan_into_the_key_and_value_gradients(backend, where, gen):
    """A row made NaN by a non-finite key or value it may attend (a backend whose kernel
    returns it finite, poisoned after the call) gives NaN gradients, as the reference's
    math does, not those of a call without that key: a NaN loss never steps with a finite
    update."""
    q, k, v = (t.requires_grad_() for t in torch.randn(3, 1, 2, 64, 8, generator=gen).unbind(0))
    bad = torch.zeros(1, 2, 64, 8)
    bad[0, 0, 3, 0] = -INF if where == "key" else INF
    out = ak.attention(q, k + bad if where == "key" else k, v + bad if where == "value" else v,
                       ak.causal(), backend=backend)
    assert torch.isnan(out[0, 0, 3:]).all() and not torch.isnan(out[0, 1]).any()
    out.sum().backward()
    assert torch.isnan(k.grad[0, 0]).any() and torch.isnan(v.grad[0, 0]).any()
    assert torch.isnan(q.grad[0, 0, 3:]).all()


@pytest.mark.parametrize("backend", ["tiled", "torch"])
def test_an_infinite_gradient_into_a_clean_call_stays_infinite(backend, gen):
    """The poisoning step multiplies the gradient by 1 + flag: 1 on clean rows, so an
    infinite upstream gradient goes on as through the math (inf where a key has weight, NaN
    only where the math makes 0 · inf), as the reference gives it."""
    leaves = torch.randn(3, 1, 2, 16, 8, generator=gen).unbind(0)
    grads = {}
    for name in (backend, "reference"):
        q, k, v = (t.clone().requires_grad_() for t in leaves)
        out = ak.attention(q, k, v, ak.causal(), backend=name)
        grad = torch.zeros_like(out)
        grad[0, 0, 5] = INF
        out.backward(grad)
        grads[name] = v.grad
    for test in (torch.isnan, torch.isinf):
        assert torch.equal(test(grads[backend]), test(grads["reference"]))
    assert torch.isinf(grads[backend][0, 0, :6]).all()


@pytest.mark.parametrize("kind", ["bias", "kv_lengths", "documents", "alibi"])
def test_a_mask_written_between_forward_and_backward_is_refused(kind, gen):
    """The tiled backward reads the mask's tensors again: a write to one after the forward
    (a preallocated buffer refilled for the next micro-batch) raises, as torch does for a
    tensor saved for backward, instead of giving the gradients of another mask."""
    t = 40
    q, k, v = (x.requires_grad_() for x in torch.randn(3, 2, 4, t, 8, generator=gen).unbind(0))
    values = {"bias": torch.randn(1, 1, t, t, generator=gen),
              "kv_lengths": torch.tensor([30, 20]), "documents": torch.arange(t) // 9,
              "alibi": torch.rand(4, generator=gen)}[kind]
    mask = {"bias": lambda: ak.bias(values), "kv_lengths": lambda: ak.padding(kv_lengths=values),
            "documents": lambda: ak.documents(values) & ak.causal(),
            "alibi": lambda: ak.causal() & ak.alibi(values)}[kind]()
    out = ak.attention(q, k, v, mask, backend="tiled")
    values[0] = values[0] - 1 if kind != "documents" else 3
    with pytest.raises(RuntimeError, match="written in place between the forward and the backward"):
        out.sum().backward()


def test_fully_masked_row_through_partial_empty_partial_blocks(gen):
    """Row 0 has no key; its key blocks are PARTIAL (others' keys), EMPTY, PARTIAL, so the tiled
    engine merges two empty partial results: out 0 and LSE −inf, not NaN."""
    tq, tk = 4, 3 * tiled.BLOCK_K
    allowed = torch.zeros(tq, tk, dtype=torch.bool)
    allowed[1:, 0] = allowed[1:, 2 * tiled.BLOCK_K + 5] = True
    q, k, v = torch.randn(3, 1, 1, tk, 8, dtype=torch.float64, generator=gen).unbind(0)
    q = q[:, :, :tq]
    plan = tiled.make_plan(ak.dense(allowed), MaskSpace(1, 1, tq, tk), batch=1, heads=1,
                           q_offset=0, q_count=tq, kv_offset=0, kv_count=tk)
    assert [s.partial for s in plan.rows[0]] == [True, True]  # the EMPTY block is skipped
    for fused in (True, False):
        r = ak.attention(q, k, v if fused else v[..., :4], allowed, backend="tiled",
                         return_lse=True)
        assert (r.out[0, 0, 0] == 0).all() and r.lse[0, 0, 0] == -INF
        assert torch.isfinite(r.out).all()


def test_the_shared_prefix_schedule_runs(gen):
    """The forward iterates ``_schedule``: with the fused kernel and causal rows it must merge
    later blocks into a shared FULL prefix (groups that are not fresh)."""
    q = torch.randn(1, 2, 1024, 16, generator=gen)
    space = MaskSpace(1, 2, 1024, 1024)
    plan = tiled.make_plan(ak.causal(), space, batch=1, heads=2, q_offset=0, q_count=1024,
                           kv_offset=0, kv_count=1024, fused=True)
    problem = tiled.Problem(ak.causal(), 0.25, space, 0, 0, plan)
    groups = [g for g, _ in tiled._schedule(problem, 1024, 2, 2, True, (q, q, q))]
    assert any(not g.fresh for g in groups)
    assert len(groups) > len(plan.rows)  # prefix calls plus each block's remainder


# ---- learnable biases ----------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 4, 9, 11), (4, 1, 11), (9, 1), (1, 11), ()], ids=str)
@pytest.mark.parametrize("backend", ["reference", "tiled", "auto"])
def test_bias_gradient(backend, shape, gen):
    q = torch.randn(2, 4, 9, 8, dtype=torch.float64, generator=gen)
    k, v = torch.randn(2, 2, 2, 11, 8, dtype=torch.float64, generator=gen).unbind(0)
    bias = torch.randn(shape, dtype=torch.float64, generator=gen).requires_grad_()
    mask = ak.bias(bias) & ak.causal("bottom_right")
    ak.attention(q, k, v, mask, backend=backend).pow(2).sum().backward()
    allowed = torch.arange(11)[None, :] <= torch.arange(9)[:, None] + 2  # bottom-right, 9×11
    expected = bias.detach().clone().requires_grad_()
    naive_attention(q, k, v, allowed, expected)[0].pow(2).sum().backward()
    torch.testing.assert_close(bias.grad, expected.grad)


def test_bias_gradcheck_tiled():
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(3, 1, 2, 6, 4, dtype=torch.float64, generator=gen).unbind(0)
    bias = torch.randn(2, 6, 6, dtype=torch.float64, generator=gen).requires_grad_()
    torch.autograd.gradcheck(
        lambda q, b: ak.attention(q, k, v, ak.bias(b) & ak.causal(), backend="tiled",
                                  return_lse=True)[:2],
        (q.requires_grad_(), bias))


def test_bias_alone_requiring_grad(gen):
    q, k, v = torch.randn(3, 1, 2, 6, 4, generator=gen).unbind(0)
    bias = torch.zeros(6, 6, requires_grad=True)
    ak.attention(q, k, v, bias).sum().backward()
    assert bias.grad is not None and bias.grad.abs().sum() > 0


def test_backends_without_bias_gradients_refuse(gen):
    q, k, v = torch.randn(3, 1, 2, 6, 4, generator=gen).unbind(0)
    bias = torch.zeros(6, 6, requires_grad=True)
    with pytest.raises(ValueError, match="bias that requires grad"):
        ak.attention(q, k, v, bias, backend="torch")


def test_fp16_bias_beyond_range_is_not_nan(gen):
    q, k, v = torch.randn(3, 1, 2, 8, 16, generator=gen).half().unbind(0)
    bias = torch.full((8, 8), 1e5)
    bias[:, 3] += 3
    out = ak.attention(q, k, v, ak.bias(bias))
    truth = naive_attention(q, k, v, None, bias)[0]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), truth, atol=2e-2, rtol=0)
    with pytest.raises(ValueError, match="would round the bias"):
        ak.attention(q, k, v, ak.bias(bias), backend="torch")


@pytest.mark.parametrize("value", [1e39, -1e39])
def test_a_float64_bias_beyond_float32_is_refused_where_it_would_overflow(value, gen):
    """A finite float64 bias past float32's range with float32 inputs: the backends that add
    it in float32 refuse it (+1e39 would be inf there, and the row NaN; a row of -1e39 would
    read as fully masked), and auto's result is the float64 truth."""
    q, k, v = torch.randn(3, 1, 1, 6, 8, generator=gen).unbind(0)
    bias = torch.zeros(6, 6, dtype=torch.float64)
    bias[0, 0] = value
    bias[1] = value  # every key of row 1: a constant shift, which softmax ignores
    for backend in ("torch", "tiled"):
        with pytest.raises(ValueError, match="beyond torch.float32's range"):
            ak.attention(q, k, v, ak.bias(bias), backend=backend)
    out = ak.attention(q, k, v, ak.bias(bias))
    truth = naive_attention(q.double(), k.double(), v.double(), None, bias)[0]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), truth, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["alibi", "float32 bias"])
def test_a_float32_bias_with_low_precision_inputs_is_added_in_float32(dtype, kind, gen):
    """fp16/bf16 scores are float32 (docs/NUMERICS.md): ALiBi over 600 keys and a float32
    bias reach values (~180) that bf16 rounds by up to 1/2 and fp16 by 1/16, so torch's
    kernel, which takes the bias in q's dtype, refuses them (whatever their values) and
    auto's result is within the output's own rounding of the float64 truth."""
    q_len = 1 if kind == "alibi" else 16
    q, k, v = (torch.randn(1, 2, t, 32, generator=gen).to(dtype) for t in (q_len, 600, 600))
    slopes = torch.tensor([0.3, 0.1])
    distance = (torch.arange(600) - torch.arange(600 - q_len, 600)[:, None]).float()
    bias = slopes[:, None, None] * distance  # [H, Tq, Tk], what ALiBi adds (bottom-right)
    mask = ak.alibi(slopes, "bottom_right") if kind == "alibi" else ak.bias(bias)
    with pytest.raises(ValueError, match="would round"):
        ak.attention(q, k, v, mask, backend="torch")
    truth = naive_attention(q, k, v, None, bias.double())[0]
    out = ak.attention(q, k, v, mask)
    limit = 2 * torch.finfo(dtype).eps * float(truth.abs().max())
    assert float((out.double() - truth).abs().max()) <= limit


# ---- torch.func and double backward --------------------------------------------------------

def test_vmap_over_per_example_padding_lengths(gen):
    """A mask built inside ``vmap`` from per-example lengths (batched tensors, whose values
    cannot be read) is evaluated as tensors: each example gets its own padding."""
    from torch.func import vmap
    q, k, v = (torch.randn(3, 2, t, 4, dtype=torch.float64, generator=gen) for t in (3, 5, 5))
    lengths = torch.tensor([1, 5, 2])

    def one(q, k, v, n):
        return ak.attention(q[None], k[None], v[None], ak.padding(kv_lengths=n[None]))[0]

    torch.testing.assert_close(vmap(one)(q, k, v, lengths),
                               ak.attention(q, k, v, ak.padding(kv_lengths=lengths)))


def test_torch_func_transforms_take_the_reference(gen):
    from torch.func import grad, jacrev, vmap
    q, k, v = torch.randn(3, 3, 2, 8, 4, dtype=torch.float64, generator=gen).unbind(0)
    mask = ak.causal()
    batched = vmap(lambda a, b, c: ak.attention(a, b, c, mask))(q, k, v)
    torch.testing.assert_close(batched, ak.attention(q, k, v, mask))
    dq = grad(lambda a: ak.attention(a, k, v, mask).sum())(q)
    _, (want, _, _) = _grads("reference", q, k, v, mask)
    leaf = q.clone().requires_grad_()
    ak.attention(leaf, k, v, mask).sum().backward()
    torch.testing.assert_close(dq, leaf.grad)
    assert jacrev(lambda a: ak.attention(a, k, v, mask).sum(-1))(q).shape == (3, 2, 8, 3, 2, 8, 4)
    with pytest.raises(ValueError, match="torch.func.*reference supports"):
        vmap(lambda a, b, c: ak.attention(a, b, c, mask, backend="tiled"))(q, k, v)


@pytest.mark.parametrize("mask", [ak.causal(), ak.causal() & ak.softcap(50.0)],
                         ids=["causal", "softcap"])
def test_forward_mode_ad_takes_the_reference(mask, gen):
    """Dual tensors (``torch.autograd.forward_ad``) go where ``torch.func.jvp`` goes: the
    reference, whose tangent is the jvp's; an explicit backend without it refuses by name."""
    import torch.autograd.forward_ad as fwAD
    q, k, v, tangent = torch.randn(4, 1, 2, 5, 4, dtype=torch.float64, generator=gen).unbind(0)
    plan = ak.plan(q, k, v, mask)  # made on plain tensors, run on dual ones
    with fwAD.dual_level():
        got = fwAD.unpack_dual(ak.attention(fwAD.make_dual(q, tangent), k, v, mask)).tangent
        planned = fwAD.unpack_dual(plan(fwAD.make_dual(q, tangent), k, v)).tangent
        with pytest.raises(ValueError, match="forward-mode AD"):
            ak.attention(fwAD.make_dual(q, tangent), k, v, mask, backend="tiled")
    _, want = torch.func.jvp(lambda a: ak.attention(a, k, v, mask, backend="reference"),
                             (q,), (tangent,))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(planned, want)


def test_forward_mode_ad_through_a_cache_decoding_step(gen):
    """A dual query over a ``KVCache`` large enough for its own decoding kernel: the cache
    leaves the step to ``attention``, which takes the reference."""
    import torch.autograd.forward_ad as fwAD
    keys, values = torch.randn(2, 1, 2, 600, 8, dtype=torch.float64, generator=gen).unbind(0)
    cache = ak.nn.KVCache(keys=keys, values=values, length=600)
    q, tangent = torch.randn(2, 1, 2, 1, 8, dtype=torch.float64, generator=gen).unbind(0)
    with fwAD.dual_level():
        got = cache.decode(fwAD.make_dual(q, tangent))
        got = ak.attention(fwAD.make_dual(q, tangent), keys, values) if got is None else got
        got = fwAD.unpack_dual(got).tangent
    _, want = torch.func.jvp(lambda a: ak.attention(a, keys, values, backend="reference"),
                             (q,), (tangent,))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_double_backward(backend, gen):
    q, k, v = torch.randn(3, 1, 2, 8, 4, dtype=torch.float64, generator=gen).unbind(0)
    bias = torch.randn(8, 8, dtype=torch.float64, generator=gen)

    def penalty(backend):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out = ak.attention(*leaves[:3], ak.bias(leaves[3]) & ak.causal(), backend=backend)
        grads = torch.autograd.grad(out.pow(2).sum(), leaves, create_graph=True)
        sum(g.pow(2).sum() for g in grads).backward()
        return [t.grad for t in leaves]

    for got, want in zip(penalty(backend), penalty("reference")):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_double_backward_with_sinks_and_a_fully_masked_row(backend, gen):
    """A row with no key gets LSE sink_h from a merge with one side empty: its second
    derivatives are finite and equal those of the softmax with the sink as one more column
    (logaddexp at −inf has a NaN second derivative)."""
    import math
    allowed = torch.ones(3, 4, dtype=torch.bool)
    allowed[1] = False
    q, k = (torch.randn(1, 1, t, 3, dtype=torch.float64, generator=gen) for t in (3, 4))
    v = torch.randn(1, 1, 4, 2, dtype=torch.float64, generator=gen)
    sink = torch.randn(1, dtype=torch.float64, generator=gen)

    def by_hand(q, k, v, s):
        scores = (q @ k.transpose(-1, -2) / math.sqrt(3)).masked_fill(~allowed, -math.inf)
        scores = torch.cat([scores, s[None, :, None, None].expand(1, 1, 3, 1)], -1)
        return torch.softmax(scores, -1)[..., :-1] @ v, torch.logsumexp(scores, -1)

    def attnkit(q, k, v, s):
        r = ak.attention(q, k, v, ak.dense(allowed) & ak.sinks(s), backend=backend,
                         return_lse=True)
        return r.out, r.lse

    def second(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
        out, lse = fn(*leaves)
        dq, = torch.autograd.grad(out.sum() + lse.sum(), leaves[0], create_graph=True)
        return torch.autograd.grad(dq.pow(2).sum(), leaves)

    for got, want in zip(second(attnkit), second(by_hand)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want)


def test_double_backward_elsewhere_is_a_clear_error(gen):
    q, k, v = torch.randn(3, 1, 2, 8, 4, generator=gen).unbind(0)
    q.requires_grad_()
    out = ak.attention(q, k, v, ak.causal(), backend="torch")
    with pytest.raises(RuntimeError, match="double backward.*'torch'.*tiled") as raised:
        torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    assert "MultiHeadAttention(...)" in str(raised.value)  # the module's users, too
    out = ak.attention(q, k, v, ak.causal(), backend="torch")
    torch.autograd.grad(out.pow(2).sum(), q)  # a first-order backward is untouched


# ---- threads -------------------------------------------------------------------------------

def test_mask_cache_is_thread_safe():
    cache = MaskCache(4)
    masks = [ak.sliding_window(w) for w in range(16)]
    errors = []

    def hammer(seed):
        try:
            for i in range(3000):
                mask = masks[(seed * 7 + i) % len(masks)]
                assert cache.get(mask, (), lambda: mask.left) == mask.left
        except Exception as error:  # noqa: BLE001 - any failure in a thread is reported
            errors.append(error)

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(cache._entries) <= 4


# ---- bad input -----------------------------------------------------------------------------

@pytest.mark.parametrize("make, kind, words", [
    (lambda: ak.padding(kv_lengths="ab"), TypeError, "padding kv_lengths"),
    (lambda: ak.padding(kv_lengths=[[1, 2], [3, 4]]), ValueError, "one length per batch"),
    (lambda: ak.sliding_window(-1), ValueError, "negative"),
])
def test_bad_mask_arguments(make, kind, words):
    with pytest.raises(kind, match=words):
        make()


def test_from_function_must_broadcast_to_the_tile(gen):
    q, k, v = torch.randn(3, 1, 2, 6, 4, generator=gen).unbind(0)
    only_queries = ak.from_function(lambda b, h, qi, ki: (qi >= 2).flatten())
    with pytest.raises(ValueError, match=r"returned shape \(6,\).*q_idx >= kv_idx"):
        ak.attention(q, k, v, only_queries)


def test_huge_window_bounds_mean_unbounded(gen):
    q, k, v = torch.randn(3, 1, 2, 6, 4, generator=gen).unbind(0)
    for backend in ("reference", "tiled", "auto"):
        torch.testing.assert_close(ak.attention(q, k, v, ak.sliding_window(0, 10**30), backend=backend),
                                   ak.attention(q, k, v, ak.sliding_window(0, 6), backend=backend))
        torch.testing.assert_close(ak.attention(q, k, v, ak.sliding_window(10**30), backend=backend),
                                   ak.attention(q, k, v, ak.causal(), backend=backend))


def test_zero_heads_is_a_clear_error():
    t = torch.randn(1, 0, 4, 8)
    for q, k in ((t, t), (t, torch.randn(1, 2, 4, 8))):
        with pytest.raises(ValueError, match="at least one head"):
            ak.attention(q, k, k)


@pytest.mark.parametrize("scale", [-0.5, 0.0])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_any_finite_scale(scale, backend, gen):
    q, k, v = torch.randn(3, 1, 2, 6, 4, dtype=torch.float64, generator=gen).unbind(0)
    torch.testing.assert_close(ak.attention(q, k, v, ak.causal(), scale=scale, backend=backend),
                               naive_attention(q, k, v, torch.ones(6, 6).tril().bool(), None,
                                               scale)[0])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_allowed_keys_all_non_finite_in_one_kernel_call_propagate(backend, gen):
    """Every key a row may see is NaN: the fused CPU kernel returns such a row as output 0 and
    LSE 0 when a call has few keys. Calls of at least ``finite.KV_CHECK_MIN_ROWS`` query rows
    check K/V, so the rows are NaN."""
    from attnkit import finite
    assert finite.KV_CHECK_MIN_ROWS <= 128
    q = torch.randn(1, 2, 128, 16, generator=gen)
    k, v = torch.randn(2, 1, 2, 4, 16, generator=gen).unbind(0)
    out = ak.attention(q, k.fill_(NAN), v, backend=backend)
    assert torch.isnan(out).all()


def test_triton_refuses_a_scale_that_is_not_positive():
    from attnkit import dispatch
    from attnkit.inputs import validate
    t = torch.randn(1, 1, 4, 16)
    reasons = dispatch.BACKENDS["triton"].not_supported_reasons(validate(t, t, t, scale=-0.5))
    assert any("scale=-0.5" in r for r in reasons)
    assert not any("scale" in r for r in dispatch.BACKENDS["triton"].not_supported_reasons(
        validate(t, t, t, scale=0.5)))


def test_compiles_to_one_graph_without_a_mask_and_causal(gen):
    """The field checks (functorch wrappers, non-finite values) stay out of a compiled graph."""
    q, k, v = torch.randn(3, 1, 2, 64, 16, generator=gen).unbind(0)
    for mask in (None, ak.causal()):
        compiled = torch.compile(lambda q, k, v: ak.attention(q, k, v, mask), fullgraph=True)
        torch.testing.assert_close(compiled(q, k, v), ak.attention(q, k, v, mask))
        grads = []
        for fn in (compiled, lambda q, k, v: ak.attention(q, k, v, mask)):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            fn(*leaves).pow(2).sum().backward()
            grads.append([t.grad for t in leaves])
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype,big", [(torch.float16, 6e4), (torch.bfloat16, 3e38),
                                       (torch.float32, 3e38)])
def test_large_finite_values_are_not_poisoned(dtype, big):
    """The poison flag never sums values: rows of huge finite queries and outputs (whose sums
    overflow the dtype) are not mistaken for non-finite ones."""
    q = torch.full((1, 1, 4, 64), big, dtype=dtype)
    k = torch.zeros(1, 1, 6, 64, dtype=dtype)
    v = torch.full((1, 1, 6, 64), big / 8, dtype=dtype)  # the kernels' sums of 6 stay finite
    out = ak.attention(q, k, v, ak.causal())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, v[:, :, :4])


def test_poison_runs_on_cpu_calls_outside_transforms():
    """GPU kernels propagate NaN by themselves; the reference (which runs torch.func
    transforms) keeps the rule by itself."""
    q = torch.randn(1, 2, 8, 4)
    inputs = validate(q, q, q, None)
    engine, reference = dispatch.BACKENDS["tiled"], dispatch.BACKENDS["reference"]
    assert finite.applies(inputs, engine)
    assert not finite.applies(inputs, reference)
    assert not finite.applies(dataclasses.replace(inputs, q=q.to("meta")), engine)
    assert not finite.applies(dataclasses.replace(inputs, transformed=True), engine)


@pytest.mark.parametrize("make", [lambda: ak.padding(kv_lengths=torch.tensor([8, 5])),
                                  lambda: ak.documents(torch.arange(8) // 3) & ak.causal(),
                                  lambda: ak.documents(torch.arange(8) // 3, causal="top_left")])
def test_masks_made_under_inference_mode(make):
    """Masks made from inference tensors (no version counter) give the same result as others:
    their cache keys read the tensors' content."""
    q = torch.randn(2, 2, 8, 4)
    with torch.inference_mode():
        mask = make()
        out = ak.attention(q, q, q, mask)
    torch.testing.assert_close(out, ak.attention(q, q, q, make()))


@pytest.mark.parametrize("backend", ["auto", "torch", "tiled"])
@pytest.mark.parametrize("make", [lambda: ak.padding(kv_lengths=[40, 23]),
                                  lambda: ak.padding(kv_starts=[0, 9]),
                                  lambda: ak.padding(kv_lengths=[40, 23])
                                  & ak.alibi(torch.tensor([0.5, 0.25]))],
                         ids=["kv_lengths", "kv_starts", "kv_lengths-alibi"])
def test_a_mask_used_in_inference_mode_then_in_training(make, backend, gen):
    """A mask a model holds serves an inference-mode pass, then a training step: what the
    first call keeps on the mask serves the second (autograd saves it), as a fresh mask."""
    q, k, v = torch.randn(3, 2, 2, 40, 8, generator=gen).unbind(0)
    mask = make()
    with torch.inference_mode():
        ak.attention(q, k, v, mask, backend=backend)
    for grad in ("q", "k"):
        leaves = {name: t.clone().requires_grad_(name == grad) for name, t in zip("qkv", (q, k, v))}
        out = ak.attention(*leaves.values(), mask, backend=backend)
        (got,) = torch.autograd.grad(out.sum(), leaves[grad])
        fresh = {name: t.clone().requires_grad_(name == grad) for name, t in zip("qkv", (q, k, v))}
        want = ak.attention(*fresh.values(), make(), backend=backend)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(got, torch.autograd.grad(want.sum(), fresh[grad])[0])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("q_len,kv_len,align,right", [(12, 12, "top_left", 0),
                                                      (5, 12, "bottom_right", 0),
                                                      (12, 5, "bottom_right", 0),
                                                      (5, 12, "top_left", 0),
                                                      (12, 12, "top_left", 3),
                                                      (12, 5, "top_left", 1)])
def test_a_key_that_silently_drops_out_poisons_the_rows_that_see_it(backend, q_len, kv_len,
                                                                      align, right, gen):
    """A key holding +inf where every query is negative scores −inf for every row, which a
    kernel would weigh 0 (a wrong finite number): causal masks and bands without a lower
    bound make exactly the rows that see it NaN, in every size of call; the others are
    exact, and a row without keys stays 0."""
    q, k, v = torch.randn(3, 2, 4, 12, 8, dtype=torch.float64, generator=gen).unbind(0)
    q, k, v = q[:, :2, :q_len], k[:, :2, :kv_len].clone(), v[:, :2, :kv_len]
    q = q.clone()
    q[..., 3] = -q[..., 3].abs() - 0.1
    bad = 3
    k[0, 1, bad, 3] = INF
    mask = ak.sliding_window(UNBOUNDED, right, align=align)
    allowed = mask.to_dense(MaskSpace(1, 1, q_len, kv_len))[0, 0]  # [Tq, Tk]
    out = ak.attention(q, k, v, mask, backend=backend)
    clean = ak.attention(q, k.nan_to_num(posinf=0.0), v, mask, backend="reference")
    sees = allowed[:, bad]
    assert sees.any()
    assert torch.isnan(out[0, 1, sees]).all()
    others = torch.ones_like(out, dtype=torch.bool)
    others[0, 1, sees] = False
    torch.testing.assert_close(out[others], clean[others], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mask", ["documents", "window", "cross_documents"])
def test_non_finite_keys_of_a_long_call_reach_every_row_that_sees_them(mask, gen):
    """Beyond ``finite.CHUNK_ELEMENTS`` scores, rows that may see a non-finite key are found
    from each row's run of keys (prefix sums), not by evaluating the mask: a whole block of
    NaN keys (which a segment-wise kernel would drop as a row of NaN scores) still makes
    every row that sees it NaN, and no other row a wrong number."""
    length = 2112  # Tq·Tk beyond CHUNK_ELEMENTS
    assert length * length > finite.CHUNK_ELEMENTS
    ids = torch.arange(length) // 700  # documents of 700 tokens
    made = {"documents": ak.documents(ids, causal="top_left"),
            "window": ak.sliding_window(40),
            "cross_documents": ak.documents(ids, causal="bottom_right")}[mask]
    q, k, v = torch.randn(3, 1, 1, length, 8, generator=gen).unbind(0)
    bad = slice(900, 964)  # one key block, all NaN
    k_bad = k.clone()
    k_bad[..., bad, :] = NAN
    out = ak.attention(q, k_bad, v, made, backend="tiled")
    allowed = made.to_dense(MaskSpace(1, 1, length, length))[0, 0]  # [Tq, Tk]
    sees_bad = allowed[:, bad].any(-1)  # [Tq]
    assert sees_bad.any() and not sees_bad.all()
    assert torch.isnan(out[0, 0, sees_bad]).all()
    clean = ak.attention(q, k, v, made, backend="tiled")[0, 0, ~sees_bad]
    rest = out[0, 0, ~sees_bad]  # NaN (spread within a tile) or exact, never another number
    kept = ~torch.isnan(rest).any(-1)
    assert kept.any()
    torch.testing.assert_close(rest[kept], clean[kept], rtol=0, atol=0)


@pytest.mark.parametrize("mask", ["documents", "causal_documents", "bottom_right_documents",
                                  "window", "causal_bottom_right", "none_left"])
def test_the_key_scan_by_runs_equals_the_scan_by_evaluation(mask, gen, monkeypatch):
    """Rows that may see a non-finite key, rows with a key, keys some row sees: from each
    row's run of keys (prefix sums; running flags for a band without a lower bound) exactly
    as from evaluating the mask."""
    tq, tk = 2100, 2300  # Tq·Tk beyond CHUNK_ELEMENTS: the scan by runs
    assert tq * tk > finite.CHUNK_ELEMENTS
    q_ids = torch.arange(tq) * 5 // tq
    kv_ids = torch.arange(tk) * 5 // tk
    made = {"documents": ak.documents(q_ids, kv_ids),
            "causal_documents": ak.documents(q_ids, kv_ids, causal="top_left"),
            "bottom_right_documents": ak.documents(q_ids, kv_ids, causal="bottom_right"),
            "window": ak.sliding_window(30, 7),
            "causal_bottom_right": ak.causal("bottom_right"),
            "none_left": ak.sliding_window(ak.masks.UNBOUNDED, 3)}[mask]
    q = torch.randn(2, 4, tq, 8, generator=gen)
    k = torch.randn(2, 2, tk, 8, generator=gen)
    bad = torch.rand(2, 2, tk, generator=gen) < 0.002
    bad[0, 1, int((kv_ids == 2).nonzero()[0])] = True  # the first key of a document
    bad[1, 0, tk - 1] = True  # the last key
    k[bad] = NAN
    inputs = validate(q, k, k, made)
    by_runs = finite._scan(inputs)
    assert finite._mask_runs(inputs) is not None
    monkeypatch.setattr(finite, "_mask_runs", lambda inputs: None)
    monkeypatch.setattr(finite, "_up_to_a_diagonal", lambda mask: False)
    by_evaluation = finite._scan(inputs)
    for name, got, want in zip(("has_key", "seen", "key_any"), by_runs, by_evaluation):
        if got is None or want is None:  # known without a scan (a band over these shapes)
            assert got is None and name != "seen" and (want is None or want.all()), name
            continue
        if name == "seen" and got.shape[1] != want.shape[1]:  # per K/V head
            got = got.repeat_interleave(want.shape[1] // got.shape[1], 1)
        got, want = torch.broadcast_tensors(got, want)
        assert torch.equal(got.isnan() if name == "seen" else got,
                           want.isnan() if name == "seen" else want), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_zero_outside_clears_whatever_is_there(dtype, gen):
    """Cleared bits give +0 where ``where`` gives 0, over NaN, ±inf and the largest values, on a
    broadcast mask and a strided view; with autograd the gradient is 0 outside."""
    x = torch.randn(2, 3, 10, 16, generator=gen).to(dtype)
    x[0, 1, 2, 3], x[1, 0, 7, 0], x[1, 2, 9, 5] = NAN, INF, torch.finfo(dtype).max
    keep = torch.rand(2, 1, 10, 1, generator=gen) < 0.5
    view = x.transpose(1, 2)  # [2, 10, 3, 16], strided
    for t, mask in ((x, keep), (view, keep.transpose(1, 2))):
        got = finite.zero_outside(t, mask)
        assert torch.equal(got.nan_to_num(7.0, 8.0, 9.0),
                           t.where(mask, 0.0).nan_to_num(7.0, 8.0, 9.0))
        assert not torch.signbit(got[~mask.expand_as(t)]).any()
        assert torch.equal(finite.zero_outside(t, finite.keep_for(mask, t)).nan_to_num(7.0),
                           got.nan_to_num(7.0))
    leaf = x.detach().clone().nan_to_num(0.0, 0.0, 0.0).requires_grad_()
    finite.zero_outside(leaf, keep).sum().backward()
    assert torch.equal(leaf.grad, keep.expand_as(leaf).to(dtype))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("q_len", [6, 70])
@pytest.mark.parametrize("kind", ["kv_lengths", "kv_starts", "kv_mask", "q_and_kv"])
def test_padding_poisons_exactly_the_rows_of_a_sequence_with_a_bad_real_key(backend, q_len,
                                                                             kind, gen):
    """Under a padding mask every real query sees all of its sequence's real keys: a key
    holding +inf where every query is negative (which a kernel would weigh 0) makes every
    real row of that sequence and head NaN, garbage past the real keys reaches nothing, and
    padded queries stay 0."""
    kv_len = 10
    q, k, v = (torch.randn(3, 3, 2, max(q_len, kv_len), 8, dtype=torch.float64,
                           generator=gen).unbind(0))
    q, k, v = q[:, :, :q_len].clone(), k[:, :, :kv_len].clone(), v[:, :, :kv_len].clone()
    q[..., 2] = -q[..., 2].abs() - 0.1
    lengths, starts = torch.tensor([7, 10, 4]), torch.tensor([3, 0, 6])
    mask = {"kv_lengths": ak.padding(kv_lengths=lengths),
            "kv_starts": ak.padding(kv_starts=starts),
            "kv_mask": ak.padding(kv_mask=torch.arange(kv_len) < lengths[:, None]),
            "q_and_kv": ak.padding(q_lengths=[q_len - 1, q_len, 2], kv_lengths=lengths)}[kind]
    space = MaskSpace(3, 2, q_len, kv_len)
    allowed = mask.to_dense(space)  # [B, 1, Tq, Tk]
    real_key = allowed.any(-2)[:, 0]  # [B, Tk]
    garbage = ~real_key[:, None, :, None].expand_as(k)
    k_bad, v_bad = k.masked_fill(garbage, NAN), v.masked_fill(garbage, INF)
    first = int(real_key[1].nonzero()[0])
    k_bad[1, 0, first, 2] = INF  # a real key of sequence 1, head 0
    out = ak.attention(q, k_bad, v_bad, mask, backend=backend)
    clean = ak.attention(q, k, v, mask, backend="reference")
    rows = allowed[1, 0].any(-1)  # the real rows of sequence 1
    assert torch.isnan(out[1, 0, rows]).all()
    others = torch.ones_like(out, dtype=torch.bool)
    others[1, 0, rows] = False
    torch.testing.assert_close(out[others], clean[others], rtol=1e-6, atol=1e-6)
    assert (out[~allowed.any(-1, keepdim=True).expand_as(out)] == 0).all()
