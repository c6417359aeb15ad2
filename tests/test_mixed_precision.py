"""Mixed precision as training and inference code uses it: ``torch.autocast`` (CPU, bfloat16
and float16) around ``attention`` and ``MultiHeadAttention``, float32 biases and score
modifier parameters beside low-precision q/k/v, loss-scaled float16 gradients, and the
errors for dtypes that do not go together.

The rule for values is the project's (docs/NUMERICS.md): error against the float64 truth,
computed from the inputs as autocast rounds them, ≤ 2 × the error of the same math done in
the autocast dtype (``plain``) + ``conftest.error_floor``, with the backward's own floors for
dq and dk (``conftest.delta_form_floors``). Dtypes must be torch's under autocast for
``F.scaled_dot_product_attention``: the output in the autocast dtype, the LSE in float32,
each gradient in its leaf's dtype.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import (assert_within_2x, delta_form_floors, dense_causal,
                      import_triton_interpreted, interpreted_triton_launch, naive_attention,
                      plain_attention)

import_triton_interpreted()  # before attnkit's first triton call (no-op without triton)

import attnkit as ak  # noqa: E402

LOW = (torch.bfloat16, torch.float16)
CPU_BACKENDS = ("reference", "tiled", "torch", "auto")


def _leaves(gen, shape=(2, 2, 12, 16), kv_shape=None, dtype=torch.float32):
    kv_shape = kv_shape or shape
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_()
            for s in (shape, kv_shape, kv_shape)]


def _runs(backend, q, k, v, mask=None, **kwargs) -> bool:
    """Whether ``backend`` takes the call (as the caller's autocast casts it)."""
    if backend == "auto":
        return True
    with ak.use_backend(backend):
        return ak.explain_dispatch(q, k, v, mask, **kwargs).backend == backend


# ---- dtypes under autocast, as torch's SDPA gives them ------------------------------------------

@pytest.mark.parametrize("dtype", LOW)
def test_torch_sdpa_under_autocast_gives_these_dtypes(gen, dtype):
    """The yardstick the tests below hold attnkit to."""
    q, k, v = _leaves(gen)
    with torch.autocast("cpu", dtype=dtype):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.float().sum().backward()
    assert out.dtype == dtype and q.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", ["causal", "padding", "documents", "sliding_window", "bias",
                                  "from_function", "softcap", "alibi", "relative_bias", "sinks"])
def test_autocast_training_step_dtypes(gen, dtype, backend, kind):
    """Forward and backward under autocast: out in the autocast dtype, LSE float32, q/k/v
    gradients float32 (their leaves' dtype), a trained bias's or modifier's gradient in its
    own dtype (float32 here, float64 for a float64 table), on every backend that takes the
    call."""
    q, k, v = _leaves(gen)
    t = q.shape[2]
    trained = []
    if kind == "causal":
        mask = ak.causal()
    elif kind == "padding":
        mask = ak.padding(kv_lengths=torch.tensor([7, 12]))
    elif kind == "documents":
        mask = ak.documents(torch.tensor([0] * 5 + [1] * 7))
    elif kind == "sliding_window":
        mask = ak.sliding_window(3)
    elif kind == "bias":
        mask = torch.randn(t, t, generator=gen).requires_grad_()
        trained = [mask]
    elif kind == "from_function":
        mask = ak.from_function(lambda b, h, i, j: j <= i)
    elif kind == "softcap":
        mask = ak.softcap(5.0) & ak.causal()
    elif kind == "alibi":
        trained = [torch.tensor([0.5, 0.25]).requires_grad_()]
        mask = ak.alibi(trained[0]) & ak.causal()
    elif kind == "relative_bias":
        trained = [torch.randn(2, 32, generator=gen, dtype=torch.float64).requires_grad_()]
        mask = ak.relative_bias(trained[0])
    else:
        trained = [torch.tensor([0.5, -1.0]).requires_grad_()]
        mask = ak.sinks(trained[0])
    lse = backend != "torch"  # (torch's kernel gives no gradient for the LSE)
    with torch.autocast("cpu", dtype=dtype):
        if not _runs(backend, q, k, v, mask, return_lse=lse):
            pytest.skip(f"{backend} does not train {kind}")
        result = ak.attention(q, k, v, mask, backend=backend, return_lse=lse)
    out = result.out if lse else result
    (out.float().sum() + (result.lse.sum() if lse else 0)).backward()
    assert out.dtype == dtype and (not lse or result.lse.dtype == torch.float32)
    for leaf in (q, k, v, *trained):
        assert leaf.grad is not None and leaf.grad.dtype == leaf.dtype
        assert torch.isfinite(leaf.grad).all()


@pytest.mark.parametrize("dtype", LOW)
def test_autocast_weights_in_the_autocast_dtype(gen, dtype):
    q, k, v = _leaves(gen)
    with torch.autocast("cpu", dtype=dtype):
        result = ak.attention(q, k, v, ak.causal(), return_weights=True)
    result.weights.float().square().sum().backward()
    assert result.weights.dtype == result.out.dtype == dtype and q.grad.dtype == torch.float32


# ---- values under autocast -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", [
    # B, Hq, Hkv, Tq, Tk, Dk, Dv, mask
    (2, 4, 2, 40, 40, 32, 32, "causal"),
    (2, 4, 1, 1, 300, 64, 64, "padding"),  # a decoding step over a long cache, MQA
    (1, 2, 2, 17, 33, 16, 8, "bias"),  # Dk != Dv, a float32 bias
])
def test_autocast_values_within_the_2x_rule(dtype, backend, case):
    """Out, dq, dk, dv of a training step under autocast against float64 on the inputs
    autocast rounded (module docstring's rule)."""
    b, hq, hkv, tq, tk, dk, dv, kind = case
    gen = torch.Generator().manual_seed(7)
    q, k, v = _leaves(gen, (b, hq, tq, dk), (b, hkv, tk, dk))
    v = torch.randn(b, hkv, tk, dv, generator=gen).requires_grad_()
    dout = torch.randn(b, hq, tq, dv, generator=gen)
    allowed = bias = None
    if kind == "causal":
        mask, allowed = ak.causal(), dense_causal(tq, tk)
    elif kind == "padding":
        lengths = torch.tensor([tk - 37, tk])
        mask = ak.padding(kv_lengths=lengths)
        allowed = (torch.arange(tk) < lengths[:, None])[:, None, None, :]
    else:
        mask = bias = 3 * torch.randn(tq, tk, generator=gen)
    with torch.autocast("cpu", dtype=dtype):
        if not _runs(backend, q, k, v, mask):
            pytest.skip(f"{backend} does not take a {kind} call with gradients")
        out = ak.attention(q, k, v, mask, backend=backend)
    out.backward(dout.to(out.dtype))
    rounded = [t.detach().to(dtype) for t in (q, k, v)]
    results = {}
    for name, dt in (("truth", torch.float64), ("plain", dtype)):
        leaves = [t.to(dt).requires_grad_() for t in rounded]
        math_out = (naive_attention(*leaves, allowed, bias) if dt == torch.float64
                    else plain_attention(*leaves, allowed, bias, dtype=dt))[0]
        math_out.backward(dout.to(dt))
        results[name] = [math_out, *(t.grad for t in leaves)]
    floors = delta_form_floors(*rounded, dout.to(dtype), allowed, bias, 1 / math.sqrt(dk))
    for name, got, truth, plain, floor in zip(
            ("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), results["truth"],
            results["plain"], (0.0, floors["dq"], floors["dk"], 0.0)):
        assert_within_2x(f"{backend} {kind} {name}", got, truth, plain, dtype, floor)


def _modifier_math(q, k, v, kind, param, dtype):
    """``out [B, H, T, D]`` of ALiBi / a relative bias / sinks written out in ``dtype``
    (differentiable in ``param``), for the 2x rule of the modifiers' gradients."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    t = q.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    distance = torch.arange(t)[None, :] - torch.arange(t)[:, None]  # j - i
    if kind == "alibi":
        scores = scores + param.to(dtype)[:, None, None] * distance.to(dtype)
    elif kind == "relative_bias":
        scores = scores + param.to(dtype)[:, distance + t - 1]
    else:  # sinks: a column of the softmax without a value
        sink = param.to(dtype)[None, :, None, None].expand(*scores.shape[:3], 1)
        return torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1] @ v
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("backend", ["reference", "tiled"])
@pytest.mark.parametrize("kind", ["alibi", "relative_bias", "sinks"])
def test_autocast_modifier_gradients_within_the_2x_rule(dtype, backend, kind):
    """A float32 slope / table / sink logit trained under autocast: its gradient (float32)
    and the output against float64, by the 2x rule with the math written out in the
    autocast dtype."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = _leaves(gen, (1, 2, 16, 16))
    dout = torch.randn(1, 2, 16, 16, generator=gen)
    t = q.shape[2]
    start = {"alibi": torch.tensor([0.5, 0.25]),
             "relative_bias": 0.5 * torch.randn(2, 2 * t - 1, generator=gen),
             "sinks": torch.tensor([0.5, -1.0])}[kind]
    param = start.clone().requires_grad_()

    def mask_of(p):
        return {"alibi": lambda: ak.alibi(p),
                "relative_bias": lambda: ak.relative_bias(
                    p, lambda rel: rel + (t - 1)),  # one bucket per distance
                "sinks": lambda: ak.sinks(p)}[kind]()

    with torch.autocast("cpu", dtype=dtype):
        out = ak.attention(q, k, v, mask_of(param), backend=backend)
    out.backward(dout.to(out.dtype))
    assert param.grad.dtype == torch.float32
    rounded = [x.detach().to(dtype) for x in (q, k, v)]
    found = {}
    for name, dt in (("truth", torch.float64), ("plain", dtype)):
        p = start.to(torch.float64 if dt == torch.float64 else torch.float32).requires_grad_()
        math_out = _modifier_math(*rounded, kind, p, dt)
        math_out.backward(dout.to(dt))
        found[name] = (math_out, p.grad)
    assert_within_2x(f"{kind} out", out, found["truth"][0], found["plain"][0], dtype)
    assert_within_2x(f"{kind} grad", param.grad, found["truth"][1], found["plain"][1], dtype)


def test_triton_under_autocast_dtypes_and_values(gen, monkeypatch):
    """``backend="triton"`` through the interpreter under bfloat16 autocast: torch's dtypes,
    values by the 2x rule (a small causal call)."""
    interpreted_triton_launch()
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the user's opt-in, for this test only
    dtype = torch.bfloat16
    q, k, v = _leaves(gen, (1, 2, 16, 16))
    dout = torch.randn(1, 2, 16, 16, generator=gen)
    with torch.autocast("cpu", dtype=dtype):
        result = ak.attention(q, k, v, ak.causal(), backend="triton", return_lse=True)
    result.out.backward(dout.to(dtype))
    assert result.out.dtype == dtype and result.lse.dtype == torch.float32
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.float32
    allowed = dense_causal(16, 16)
    rounded = [t.detach().to(dtype) for t in (q, k, v)]
    truth, plain = [], []
    for into, dt in ((truth, torch.float64), (plain, dtype)):
        leaves = [t.to(dt).requires_grad_() for t in rounded]
        o = (naive_attention(*leaves, allowed) if dt == torch.float64
             else plain_attention(*leaves, allowed, dtype=dt))[0]
        o.backward(dout.to(dt))
        into.extend([o, *(t.grad for t in leaves)])
    floors = delta_form_floors(*rounded, dout.to(dtype), allowed, None, 0.25)
    for name, got, t, p, floor in zip(("out", "dq", "dk", "dv"),
                                      (result.out, q.grad, k.grad, v.grad), truth, plain,
                                      (0.0, floors["dq"], floors["dk"], 0.0)):
        assert_within_2x(f"triton {name}", got, t, p, dtype, floor)


@pytest.mark.parametrize("backend", ["reference", "torch", "auto"])
def test_backward_inside_autocast_equals_outside(gen, backend):
    """``loss.backward()`` inside the autocast region gives the gradients it gives after it
    (the tiled engine's case: test_usability)."""
    grads = []
    for inside in (True, False):
        q, k, v = _leaves(torch.Generator().manual_seed(5))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ak.attention(q, k, v, ak.causal(), backend=backend)
            if inside:
                out.float().sum().backward()
        if not inside:
            out.float().sum().backward()
        grads.append((q.grad, k.grad, v.grad))
    for inside, outside in zip(*grads):
        torch.testing.assert_close(inside, outside, atol=0, rtol=0)


# ---- loss scaling -----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "tiled", "auto"])
def test_loss_scaled_float16_gradients_are_finite_where_torchs_are(backend):
    """GradScaler's large upstream gradients under float16 autocast (up to 30000 here, past
    which dO·V overflows float16 in torch's own backward): finite, and as close to float64 as
    torch's; an inf or NaN upstream gradient reaches q, k and v (the scaler skips the step)."""
    gen = torch.Generator().manual_seed(3)
    dout = torch.randn(1, 2, 64, 64, generator=gen)
    dout = dout / dout.abs().max() * 30000.0
    errors = {}
    for name in ("torch sdpa", backend, "truth"):
        q, k, v = _leaves(torch.Generator().manual_seed(4), (1, 2, 64, 64))
        if name == "truth":
            rounded = [t.detach().half().double().requires_grad_() for t in (q, k, v)]
            naive_attention(*rounded, dense_causal(64, 64))[0].backward(dout.half().double())
            truth = [t.grad for t in rounded]
            continue
        with torch.autocast("cpu", dtype=torch.float16):
            out = (F.scaled_dot_product_attention(q, k, v, is_causal=True) if name == "torch sdpa"
                   else ak.attention(q, k, v, ak.causal(), backend=backend))
        out.backward(dout.half())
        errors[name] = [q.grad, k.grad, v.grad]
    for theirs, ours, exact in zip(errors["torch sdpa"], errors[backend], truth):
        assert torch.isfinite(theirs).all() and torch.isfinite(ours).all()
        their_error = (theirs.double() - exact).abs().max()
        floor = torch.finfo(torch.float16).eps * exact.abs().max()
        assert (ours.double() - exact).abs().max() <= 2 * their_error + floor
    for bad in (float("inf"), float("nan")):
        q, k, v = _leaves(torch.Generator().manual_seed(4), (1, 2, 16, 16))
        upstream = torch.randn(1, 2, 16, 16, generator=gen)
        upstream[0, 1, 5, 3] = bad
        with torch.autocast("cpu", dtype=torch.float16):
            out = ak.attention(q, k, v, ak.causal(), backend=backend)
        out.backward(upstream.half())
        assert not any(torch.isfinite(t.grad).all() for t in (q, k, v))


# ---- dtypes that do not go together -----------------------------------------------------------

@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_mixed_input_dtypes_are_refused_alike_on_every_backend(gen, backend):
    q, k, v = _leaves(gen)
    with pytest.raises(TypeError, match=r"share one dtype.*bfloat16.*float32.*k\.to\(q\.dtype\)"):
        ak.attention(q.bfloat16(), k, v, backend=backend)
    with pytest.raises(TypeError, match=r"bias of shape \(12, 12\) has dtype torch.float16 but "
                                        r"q has torch.bfloat16.*\.float\(\), or "
                                        r"\.to\(q\.dtype\)"):
        ak.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                     torch.zeros(12, 12, dtype=torch.float16), backend=backend)


def test_a_bias_in_another_low_precision_dtype_under_autocast_names_a_fix_that_runs(gen):
    """Under float16 autocast a bfloat16 bias is refused (a bias is float32, float64 or q's
    dtype): the message says q runs in the autocast dtype and names ``.float()``, and the
    call with the bias so cast runs, its gradient in the bias's dtype."""
    q, k, v = (t.bfloat16() for t in _leaves(gen))
    bias = torch.randn(12, 12, generator=gen).bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.float16):
        with pytest.raises(TypeError, match=r"q has torch.float16 \(under torch.autocast, "
                                            r"the autocast dtype.*\.float\(\)"):
            ak.attention(q, k, v, bias)
        out = ak.attention(q, k, v, bias.float())
    out.float().sum().backward()
    assert out.dtype == torch.float16 and bias.grad.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(
            TypeError, match=r"q has torch.float64: .*\.float\(\) or \.to\(q\.dtype\)"):
        ak.attention(q.double(), k.double(), v.double(), bias)  # autocast leaves float64 alone


def test_float64_next_to_autocast_names_what_autocast_leaves(gen):
    """float64 is not cast by autocast (as torch's): a float64 k beside a float32 q under
    autocast is refused, the message saying why and what to pass."""
    q, k, v = _leaves(gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(TypeError, match=r"share one dtype.*float64 tensors keep their dtype"):
            ak.attention(q, k.double(), v)


@pytest.mark.parametrize("backend", ["reference", "tiled", "auto"])
def test_float32_and_float64_parameters_beside_low_precision_inputs(gen, backend):
    """A float32 bias with bfloat16 q, and a float64 relative table and ALiBi slopes with
    float32 q, run on every backend that trains them; each gradient in its tensor's dtype;
    the output in q's dtype."""
    q, k, v = _leaves(gen, dtype=torch.bfloat16)
    bias = torch.randn(12, 12, generator=gen).requires_grad_()
    out = ak.attention(q, k, v, bias, backend=backend)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and bias.grad.dtype == torch.float32
    q, k, v = _leaves(gen)
    table = torch.randn(2, 32, generator=gen, dtype=torch.float64).requires_grad_()
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64).requires_grad_()
    out = ak.attention(q, k, v, ak.relative_bias(table) & ak.alibi(slopes), backend=backend)
    out.sum().backward()
    assert out.dtype == torch.float32
    assert table.grad.dtype == slopes.grad.dtype == torch.float64


# ---- modules ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", LOW)
def test_multihead_attention_under_autocast_as_torchs(dtype):
    torch_mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    mha = ak.nn.MultiHeadAttention.from_torch(torch_mha)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=dtype):
        ours = mha(x, need_weights=True, is_causal=True)
        theirs = torch_mha(x, x, x, need_weights=True, average_attn_weights=False,
                           attn_mask=torch.ones(6, 6, dtype=torch.bool).triu(1))
    assert ours.out.dtype == theirs[0].dtype == dtype
    assert ours.weights.dtype == theirs[1].dtype == dtype
    ours.out.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in mha.parameters())


def test_multihead_attention_in_bfloat16(gen):
    mha = ak.nn.MultiHeadAttention(32, 4).to(torch.bfloat16)
    x = torch.randn(2, 6, 32, generator=gen)
    assert mha(x.bfloat16(), is_causal=True).out.dtype == torch.bfloat16
    with pytest.raises(TypeError, match=r"query has dtype torch.float32 but MultiHeadAttention's "
                                        r"weights are torch.bfloat16"):
        mha(x, is_causal=True)
    with torch.autocast("cpu", dtype=torch.float16):
        assert mha(x, is_causal=True).out.dtype == torch.float16


def test_kv_cache_decoding_under_autocast(gen):
    """A prefill and decoding steps under autocast give the full sequence's autocast output
    to its rounding; a step on the other side of autocast is refused by name."""
    mha = ak.nn.MultiHeadAttention(32, 4)
    x = torch.randn(2, 6, 32, generator=gen)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        whole = mha(x, is_causal=True).out
        step = mha(x[:, :4], is_causal=True, cache=mha.empty_cache())
        outs, cache = [step.out], step.cache
        for i in (4, 5):
            step = mha(x[:, i:i + 1], is_causal=True, cache=cache)
            outs.append(step.out)
            cache = step.cache
    assert cache.keys.dtype == torch.bfloat16
    torch.testing.assert_close(torch.cat(outs, 1), whole)  # bfloat16's tolerance
    with torch.no_grad(), pytest.raises(TypeError, match="same side of autocast"):
        mha(x[:, :1], is_causal=True, cache=cache)


# ---- torch.compile ----------------------------------------------------------------------------

def test_compiled_autocast_training_step_equals_eager():
    """An autocast training step with a trained ALiBi slope under torch.compile gives eager's
    output and gradients."""
    def step(compiled: bool):
        gen = torch.Generator().manual_seed(2)
        q, k, v = _leaves(gen, (1, 2, 32, 16))
        slopes = torch.tensor([0.5, 0.25]).requires_grad_()

        def f(q, k, v, slopes):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return ak.attention(q, k, v, ak.alibi(slopes) & ak.causal())

        out = (torch.compile(f) if compiled else f)(q, k, v, slopes)
        out.float().square().sum().backward()
        return out, q.grad, k.grad, v.grad, slopes.grad

    for eager, compiled in zip(step(False), step(True)):
        assert eager.dtype == compiled.dtype
        torch.testing.assert_close(compiled, eager)
