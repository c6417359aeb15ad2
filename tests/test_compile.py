"""``torch.compile``: every mask kind compiles to one graph (``fullgraph=True``), built inside or
outside the compiled region, forward and backward equal to eager.

Most cases compile with ``backend="aot_eager"`` (dynamo + AOT autograd: the graph capture, the
fake implementations and the registered autograd, without inductor's code generation time);
a few go through inductor, whose generated code also asserts the operators' output strides.
"""

from __future__ import annotations

import pytest
import torch
from conftest import import_triton_interpreted, interpreted_triton_launch

import_triton_interpreted()  # before dynamo and attnkit: the triton case runs interpreted

import torch._dynamo  # noqa: E402

import attnkit as ak  # noqa: E402
from attnkit import compiled  # noqa: E402
from attnkit.nn import MultiHeadAttention  # noqa: E402

B, H, T, D = 2, 2, 96, 16
LENGTHS = torch.tensor([70, 96])
STARTS = torch.tensor([0, 21])
REAL = torch.arange(T)[None, :] >= torch.tensor([[9], [0]])  # [B, T]: left padding of row 0
IDS = torch.arange(T) // 24
BIAS = torch.randn(1, H, T, T)
ALLOWED = torch.rand(B, 1, T, T) > 0.4

MASKS = {
    "window": lambda: ak.sliding_window(11),
    "window_two_sided": lambda: ak.sliding_window(5, 7, align="bottom_right"),
    "causal_bottom_right": lambda: ak.causal("bottom_right"),
    "padding": lambda: ak.padding(kv_lengths=LENGTHS, q_lengths=LENGTHS),
    "padding_starts": lambda: ak.padding(kv_starts=STARTS),
    "padding_real_mask": lambda: ak.padding(kv_mask=REAL) & ak.causal(),
    "documents&causal": lambda: ak.documents(IDS) & ak.causal(),
    "documents|window": lambda: ak.documents(IDS) | ak.sliding_window(3),
    "~causal": lambda: ~ak.causal(),
    "dense": lambda: ak.dense(ALLOWED),
    "bool_tensor": lambda: ALLOWED,
    "bias&causal": lambda: ak.bias(BIAS) & ak.causal(),
    "from_function": lambda: ak.from_function(lambda b, h, i, j: (i - j) % 3 == 0) & ak.causal(),
    "causal_per_sequence": lambda: ak.causal(
        "bottom_right", sequences=ak.padding(q_lengths=LENGTHS - 9, kv_starts=STARTS)),
    "window_per_sequence": lambda: ak.sliding_window(6, sequences=ak.padding(kv_mask=REAL)),
    "documents_causal_segments": lambda: ak.documents(IDS, (torch.arange(T) * 5) // (T + 1),
                                                      causal="bottom_right"),
}


def _qkv(seed: int, shape=(B, H, T, D)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, requires_grad=True) for _ in range(3)]


def _run(fn, tensors):
    """``fn``'s output and the gradients of its sum with respect to ``tensors``."""
    out = fn(*tensors[:3])
    grads = torch.autograd.grad(out.sum(), tensors)
    return out.detach(), grads


def _breaks(fn, *args) -> int:
    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(*args).graph_break_count


@pytest.mark.parametrize("inside", [False, True], ids=["built_outside", "built_inside"])
@pytest.mark.parametrize("name", sorted(MASKS))
def test_every_mask_compiles_to_one_graph_forward_and_backward(name, inside):
    if inside and name == "~causal":
        pytest.skip("dynamo cannot trace the unary ~ of a Python object: build ~mask outside")
    make = MASKS[name]
    mask = make()

    def fn(q, k, v):
        return ak.attention(q, k, v, make() if inside else mask)

    q, k, v = _qkv(len(name))
    assert _breaks(fn, q, k, v) == 0
    out, grads = _run(torch.compile(fn, backend="aot_eager", fullgraph=True), [q, k, v])
    expected, expected_grads = _run(fn, [q, k, v])
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["padding_real_mask", "documents&causal", "bias&causal"])
def test_inductor_compiles_structured_masks(name):
    """Inductor's generated code checks the operators' strides against their fake versions; the
    inputs are views of a fused projection (strided) as in a model."""
    mask = MASKS[name]()
    fused = torch.randn(B, T, 3 * H * D, requires_grad=True)

    def fn(x):
        q, k, v = x.unflatten(-1, (3, H, D)).permute(2, 0, 3, 1, 4).unbind(0)  # [B, H, T, D] views
        return ak.attention(q, k, v, mask)

    out, (grad,) = _run(lambda x, *_: torch.compile(fn, fullgraph=True)(x), [fused])
    expected, (expected_grad,) = _run(lambda x, *_: fn(x), [fused])
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grad, expected_grad)


def test_learnable_bias_gets_its_gradient_when_compiled():
    bias = torch.randn(1, H, T, T, requires_grad=True)
    window = ak.sliding_window(20)

    def fn(q, k, v):
        result = ak.attention(q, k, v, ak.bias(bias) & window, return_lse=True)
        return result.out.sum(-1) + result.lse.nan_to_num(0.0, 0.0, 0.0)

    q, k, v = _qkv(3)
    assert _breaks(fn, q, k, v) == 0
    out, grads = _run(torch.compile(fn, backend="aot_eager", fullgraph=True), [q, k, v, bias])
    expected, expected_grads = _run(fn, [q, k, v, bias])
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


def test_a_compiled_helper_takes_new_window_sizes_and_softcap_values():
    """Window size and softcap cap passed to a compiled helper as Python numbers: each new
    pair runs (a cap that dynamo makes a graph input is not readable there), forward and
    backward equal to eager."""
    def fn(q, k, v, window, cap):
        return ak.attention(q, k, v, ak.sliding_window(window) & ak.softcap(cap))

    helper = torch.compile(fn, backend="aot_eager", fullgraph=True)
    q, k, v = _qkv(4)
    for window, cap in [(4, 5.0), (8, 5.0), (8, 7.5), (16, 30.0)]:
        out, grads = _run(lambda *t: helper(*t, window, cap), [q, k, v])
        expected, expected_grads = _run(lambda *t: fn(*t, window, cap), [q, k, v])
        torch.testing.assert_close(out, expected)
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_score_modifiers_compile_with_their_gradients(backend, monkeypatch):
    """Softcap, ALiBi, a T5 relative bias and sinks under causal masking: one graph, out and
    LSE as eager, and the gradients of q, k, v, the slopes, the table and the sink logits,
    which the operator's backward takes from the backend's own (tiled; triton through the
    interpreter), the sinks joined in the graph."""
    if backend == "triton":
        interpreted_triton_launch()
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(7)
    slopes = (torch.rand(H, generator=gen) * 0.3).requires_grad_()
    table = torch.randn(H, 32, generator=gen, requires_grad=True)
    sinks = torch.randn(H, generator=gen, requires_grad=True)

    def fn(q, k, v, backend=backend):
        mask = (ak.causal() & ak.softcap(2.0) & ak.alibi(slopes) & ak.relative_bias(table)
                & ak.sinks(sinks))
        result = ak.attention(q, k, v, mask, return_lse=True, backend=backend)
        return result.out.sum(-1) + result.lse

    q, k, v = _qkv(11)
    assert _breaks(fn, q, k, v) == 0
    tensors = [q, k, v, slopes, table, sinks]
    out, grads = _run(torch.compile(fn, backend="aot_eager", fullgraph=True), tensors)
    expected, expected_grads = _run(lambda q, k, v: fn(q, k, v, "reference"), tensors)
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def _compiled_modifiers_peak(rank: int, world: int, length: int) -> int:
    """Peak memory growth (bytes) of a compiled forward + backward with learned ALiBi slopes,
    a learned T5 table and a softcap over ``length`` keys, causal (run in its own process:
    :class:`PeakMemory` changes the C allocator's settings)."""
    from attnkit.distributed import PeakMemory

    torch.set_num_threads(1)
    meter = PeakMemory()
    slopes = torch.tensor([0.1], requires_grad=True)
    table = torch.randn(1, 32, requires_grad=True)
    q, k, v = (torch.randn(1, 1, length, 8, requires_grad=True) for _ in range(3))

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(q, k, v):
        mask = ak.causal() & ak.softcap(20.0) & ak.alibi(slopes) & ak.relative_bias(table)
        return ak.attention(q, k, v, mask)

    step(q, k, v).sum().backward()  # compiles; pages library code in
    with meter:
        step(q, k, v).sum().backward()
    assert slopes.grad is not None and table.grad is not None
    return meter.peak


def test_compiled_score_modifiers_backward_holds_no_score_matrix():
    """At T = 8192 one float32 score matrix is 256 MiB: the compiled forward and backward with
    softcap, ALiBi and a relative bias (slopes and table learned) stay under a quarter of it,
    O(T) memory through the tiled engine's own backward, not a re-differentiated reference."""
    from attnkit.distributed import spawn

    length = 8192
    (peak,) = spawn(_compiled_modifiers_peak, 1, length, threads=1)
    assert peak < length * length, peak


def test_weights_and_unbatched_inputs_when_compiled():
    q, k, v = (t.detach() for t in _qkv(4, (T, D)))
    window = ak.sliding_window(7)

    def fn(q, k, v):
        return ak.attention(q, k, v, window, return_weights=True)

    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)
    want = fn(q, k, v)
    torch.testing.assert_close(got.out, want.out)
    torch.testing.assert_close(got.weights, want.weights)
    assert got.lse is None


def test_multi_head_attention_compiles_with_key_padding_and_causal():
    torch.manual_seed(5)
    module = MultiHeadAttention(32, 4)
    x = torch.randn(B, T, 32)

    def fn(x):
        return module(x, key_valid=REAL, is_causal=True).out

    assert _breaks(fn, x) == 0
    compiled_fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out = compiled_fn(x)
    grads = torch.autograd.grad(out.sum(), list(module.parameters()))
    expected = fn(x)
    expected_grads = torch.autograd.grad(expected.sum(), list(module.parameters()))
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("layout", ["contiguous", "fused_qkv"])
@pytest.mark.parametrize("heads_kv", [2, 1])
@pytest.mark.parametrize("mask", [None, "causal"])
def test_dynamic_shapes_trace_torch_s_kernel(mask, heads_kv, layout):
    """With ``dynamic=True`` every size is symbolic: no mask and top-left causal, traced as
    torch's own kernel, still compile to one graph equal to eager, GQA included, on
    contiguous tensors and on the ``[B, T, H, D]`` views of a fused QKV projection (whose
    strides are symbolic too)."""
    torch._dynamo.reset()
    if layout == "contiguous":
        q = _qkv(2, (B, H, 12, D))[0]
        k, v = _qkv(3, (B, heads_kv, 12, D))[:2]
    else:
        fused = _qkv(2, (B, 12, H + 2 * heads_kv, D))[0]
        q, k, v = (t.transpose(1, 2) for t in fused.split([H, heads_kv, heads_kv], 2))

    def fn(q, k, v):
        return ak.attention(q, k, v, None if mask is None else ak.causal())

    out, grads = _run(torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True),
                      [q, k, v])
    want, want_grads = _run(fn, [q, k, v])
    torch.testing.assert_close(out, want)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected)


def test_a_cache_with_lengths_and_a_plan_made_inside_compile():
    """A ``KVCache`` appended with per-sequence ``lengths`` and a plan made inside the compiled
    region trace to one graph each, equal to eager."""
    torch._dynamo.reset()
    torch.manual_seed(6)
    module = MultiHeadAttention(32, 4, 2).eval()
    chunk, lengths = torch.randn(2, 5, 32), torch.tensor([5, 2])

    def prefill(x, lengths):
        out, _, cache = module(x, is_causal=True, cache=module.empty_cache(), lengths=lengths)
        return out, cache.keys

    def planned(q, k, v):
        return ak.plan(q, k, v, ak.sliding_window(3))(q, k, v)

    with torch.no_grad():
        for fn, args in ((prefill, (chunk, lengths)), (planned, _qkv(7, (B, H, 12, D)))):
            got = torch.compile(fn, backend="aot_eager", fullgraph=True)(*args)
            torch.testing.assert_close(got, fn(*args))


def test_bad_values_are_reported_when_the_compiled_graph_runs():
    """Values a trace cannot read (a padding mask whose real tokens are not one run) are
    checked when the operator runs, with the eager message's advice."""
    broken = REAL.clone()
    broken[1, 40] = False

    def fn(q, k, v):
        return ak.attention(q, k, v, ak.padding(kv_mask=broken))

    q, k, v = (t.detach() for t in _qkv(6))
    with pytest.raises(ValueError, match="not one contiguous run"):
        torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)


def test_dropout_with_a_structured_mask_is_refused_when_compiled():
    def fn(q, k, v):
        return ak.attention(q, k, v, ak.sliding_window(4), dropout_p=0.1)

    q, k, v = (t.detach() for t in _qkv(7))
    with pytest.raises(Exception, match="dropout_p=0.1"):
        torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)


def test_flatten_round_trips_every_mask():
    """The spec and tensors rebuild a mask that allows exactly the same pairs."""
    space = ak.masks.MaskSpace(B, H, T, T)
    for name, make in MASKS.items():
        mask = ak.masks.as_mask(make())
        spec, tensors, numbers = compiled.flatten(mask, space)
        rebuilt = compiled.unflatten(spec, tensors, numbers)
        assert torch.equal(rebuilt.to_dense(space), mask.to_dense(space)), name
        if mask.has_bias:
            assert torch.equal(rebuilt.dense_bias(space), mask.dense_bias(space)), name


def test_triton_kernels_run_inside_a_compiled_graph(monkeypatch):
    """The operator's backward comes from the triton backend's own kernels (interpreter)."""
    interpreted_triton_launch()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = _qkv(8, (B, H, 40, D))
    mask = ak.padding(kv_mask=REAL[:, :40]) & ak.sliding_window(9)

    def fn(q, k, v):
        return ak.attention(q, k, v, mask, backend="triton")

    out, grads = _run(torch.compile(fn, backend="aot_eager", fullgraph=True), [q, k, v])
    expected, expected_grads = _run(lambda q, k, v: ak.attention(q, k, v, mask, backend="tiled"),
                                    [q, k, v])
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


def test_returned_weights_under_compile_are_for_reading_only():
    """Weights returned beside the output (e.g. to log them) leave its gradients exact; a loss
    that differentiates the weights themselves raises instead of dropping their gradient."""
    window = ak.sliding_window(7)

    def out_and_weights(q, k, v):
        result = ak.attention(q, k, v, window, return_weights=True)
        return result.out, result.weights

    step = torch.compile(out_and_weights, backend="aot_eager", fullgraph=True)
    q, k, v = _qkv(9)
    out, weights = step(q, k, v)
    grads = torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True)
    expected = torch.autograd.grad(ak.attention(q, k, v, window).sum(), (q, k, v))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)
    with pytest.raises(RuntimeError, match="not differentiable"):
        weights.pow(2).sum().backward()


@pytest.mark.parametrize("kind", ["padding", "documents"])
def test_the_operator_keys_no_tensor_by_identity(kind):
    """Inductor may hand the operator a buffer it reused, rewritten by its own kernel: the
    same tensor, the same version counter, new values. The operator then derives everything
    from the values it gets (here the rewrite bypasses the counter through ``.data``)."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 2, 12, 8, generator=gen) for _ in range(3))
    values = {"padding": ([12, 5], [3, 9]),
              "documents": ([[0] * 6 + [1] * 6] * 2, [[0] * 2 + [1] * 10] * 2)}[kind]
    held = torch.tensor(values[0])
    make = {"padding": lambda t: ak.padding(kv_lengths=t), "documents": ak.documents}[kind]
    for value in values:
        held.data.copy_(torch.tensor(value))  # (no version bump, as inductor's kernels)
        out, _, _ = compiled.attention(q, k, v, make(held), scale=None, dropout_p=0.0,
                                       backend="auto", return_lse=False, return_weights=False)
        want = ak.attention(q.double(), k.double(), v.double(), make(torch.tensor(value)),
                            backend="reference")
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_sinks_made_inside_a_dynamic_graph_trace_whole():
    """Sink logits built inside the compiled function over symbolic head counts: the shape
    check compares size by size (as guards), so ``fullgraph=True`` holds."""
    def fn(q, k, v):
        return ak.attention(q, k, v, ak.sinks(torch.tensor([0.3, -0.2]))
                            & ak.causal("bottom_right"))

    compiled_fn = torch.compile(fn, backend="aot_eager", dynamic=True, fullgraph=True)
    gen = torch.Generator().manual_seed(9)
    for t, s in ((9, 9), (6, 10)):
        q = torch.randn(2, 2, t, 8, generator=gen)
        k, v = (torch.randn(2, 2, s, 8, generator=gen) for _ in range(2))
        torch.testing.assert_close(compiled_fn(q, k, v), fn(q, k, v))


def test_inside_the_operator_cpu_tensors_are_keyed_by_content():
    """What the operator derives from a CPU mask tensor stays cached between calls while its
    values do (a read without a device sync), whatever its version counter says."""
    from attnkit.masks import tensor_key, unkeyed

    lengths = torch.tensor([12, 5])
    with unkeyed():
        first = tensor_key(lengths, [])
        assert tensor_key(lengths, []) == first
        lengths.data.copy_(torch.tensor([3, 9]))  # (no version bump)
        assert tensor_key(lengths, []) != first
    assert tensor_key(lengths, [])[-1] == lengths._version  # outside: by version counter
