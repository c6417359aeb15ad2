"""Edge inputs of ``attention()``: empty calls (B, Tq or Tk of 0) on every backend, and the
values a score modifier refuses (score functions' result shapes, bucket ids outside the
relative-bias table, softcaps outside float32's normal range).

Empty calls are a grid: Tq ∈ {0, 3} × Tk ∈ {0, 5} (and B = 0) × masks and modifiers ×
backends × float32/float16 × forward and backward, each against the float64 reference
(``backend="reference"`` on float64 copies). A backend refuses an empty call exactly when it
refuses the same call with Tq = 3, Tk = 5: its reasons never depend on the call being empty.
The triton backend runs on CPU through the interpreter (``TRITON_INTERPRET=1``, set per test
as ``tests/test_triton.py`` does; its cases skip where triton runs compiled).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from conftest import import_triton_interpreted, interpreted_triton_launch

import_triton_interpreted()

import attnkit as ak  # noqa: E402
from attnkit import dispatch  # noqa: E402
from attnkit.inputs import validate  # noqa: E402

H, HKV, D, DV = 4, 2, 8, 6
BACKENDS = ["reference", "torch", "tiled", "triton", "auto"]


# ---- the calls ----------------------------------------------------------------------------------

def _mask(name: str, batch: int, tq: int, tk: int, leaves: dict):
    """``(mask, the learnable tensors it reads)`` for a call of ``batch`` × ``tq`` × ``tk``;
    ``leaves``: the learnable tensors by name (fresh leaves, float32)."""
    const_slopes = torch.linspace(0.2, 0.8, H)
    const_table = torch.linspace(-1.0, 1.0, H * 8).reshape(H, 8)
    ids_q = torch.zeros(batch, tq, dtype=torch.long)  # one document per batch element
    ids_k = torch.zeros(batch, tk, dtype=torch.long)
    made = {
        "none": lambda: (None, []),
        "causal": lambda: (ak.causal(), []),
        "causal_bottom_right": lambda: (ak.causal("bottom_right"), []),
        "padding": lambda: (ak.padding(kv_lengths=[min(tk, 2)] * batch) if batch else
                            ak.padding(kv_lengths=torch.zeros(0, dtype=torch.long)), []),
        "documents_causal": lambda: (ak.documents(ids_q, ids_k, causal="bottom_right"), []),
        "alibi_learned": lambda: (ak.causal() & ak.alibi(leaves["slopes"]), [leaves["slopes"]]),
        "alibi_constant": lambda: (ak.alibi(const_slopes, "bottom_right"), []),
        "relative_learned": lambda: (ak.relative_bias(leaves["table"]), [leaves["table"]]),
        "relative_constant_buckets": lambda: (
            ak.relative_bias(const_table, buckets=lambda r: r.clamp(-3, 4) + 3), []),
        "sinks": lambda: (ak.causal("bottom_right") & ak.sinks(leaves["sinks"]), [leaves["sinks"]]),
        "softcap": lambda: (ak.causal() & ak.softcap(5.0), []),
        "score_function": lambda: (ak.score_function(lambda s, b, h, i, j: s - 0.1 * (i - j).abs()),
                                   []),
        "bias_learned": lambda: (ak.bias(leaves["bias"][:, :, :tq, :tk]), [leaves["bias"]]),
    }
    return made[name]()


MASKS = ["none", "causal", "causal_bottom_right", "padding", "documents_causal", "alibi_learned",
         "alibi_constant", "relative_learned", "relative_constant_buckets", "sinks", "softcap",
         "score_function", "bias_learned"]

SHAPES = [(2, 0, 0), (2, 0, 5), (2, 3, 0), (2, 3, 5), (0, 3, 5), (0, 0, 0)]
"""``(B, Tq, Tk)``: the empty ones, and ``(2, 3, 5)``, the same call with work to do."""


def _leaves(dtype: torch.dtype = torch.float32) -> dict:
    gen = torch.Generator().manual_seed(7)
    values = {"slopes": torch.rand(H, generator=gen, dtype=torch.float64),
              "table": torch.randn(H, 8, generator=gen, dtype=torch.float64),
              "sinks": torch.randn(H, generator=gen, dtype=torch.float64),
              "bias": torch.randn(1, H, 3, 5, generator=gen, dtype=torch.float64)}
    return {name: t.to(dtype).requires_grad_() for name, t in values.items()}


def _qkv(batch: int, tq: int, tk: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    shapes = ((batch, H, tq, D), (batch, HKV, tk, D), (batch, HKV, tk, DV))
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
            for s in shapes]


def _call(backend: str, dtype: torch.dtype, name: str, shape: tuple, returns: str,
          leaf_dtype: torch.dtype = torch.float32):
    """Run one call forward and backward → ``(out, lse or None, weights or None, gradients
    of q, k, v and the mask's learnable tensors)``. The loss weighs out (and the LSE's finite
    entries) by fixed random factors."""
    batch, tq, tk = shape
    q, k, v = _qkv(batch, tq, tk, dtype)
    mask, learned = _mask(name, batch, tq, tk, _leaves(leaf_dtype))
    result = ak.attention(q, k, v, mask, backend=backend, return_lse=returns == "lse",
                          return_weights=returns == "weights")
    out, lse, weights = (result, None, None) if returns == "out" else result
    gen = torch.Generator().manual_seed(11)
    loss = (out.double() * torch.randn(out.shape, generator=gen, dtype=torch.float64)).sum()
    if lse is not None:
        finite = torch.where(torch.isfinite(lse), lse, 0).double()
        loss = loss + (finite * torch.randn(lse.shape, generator=gen, dtype=torch.float64)).sum()
    if weights is not None:
        loss = loss + (weights.double() * torch.randn(weights.shape, generator=gen,
                                                      dtype=torch.float64)).sum()
    grads = torch.autograd.grad(loss, [q, k, v, *learned]) if loss.requires_grad else None
    return out, lse, weights, grads


def _refuses(backend: str, dtype: torch.dtype, name: str, returns: str) -> bool:
    """Whether ``backend`` refuses the call with work to do (B 2, Tq 3, Tk 5)."""
    if backend == "auto":
        return False
    q, k, v = _qkv(2, 3, 5, dtype)
    mask, _ = _mask(name, 2, 3, 5, _leaves())
    inputs = validate(q, k, v, mask, need_lse=returns == "lse", need_weights=returns == "weights")
    return bool(dispatch.BACKENDS[backend].not_supported_reasons(inputs))


def _prepare(backend: str, monkeypatch) -> None:
    if backend == "triton":
        if importlib.util.find_spec("triton") is None:
            pytest.skip("triton is not installed")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        interpreted_triton_launch()  # skips where triton runs compiled


def _check_against_reference(backend, dtype, name, shape, returns):
    batch, tq, tk = shape
    out, lse, weights, grads = _call(backend, dtype, name, shape, returns)
    truth_out, truth_lse, truth_weights, truth_grads = _call("reference", torch.float64, name,
                                                             shape, returns, torch.float64)
    assert out.shape == (batch, H, tq, DV) and out.dtype == dtype
    empty = batch == 0 or tq == 0 or tk == 0
    tol = dict(rtol=0, atol=0) if empty else (
        dict(rtol=2e-2, atol=2e-2) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-5))
    if empty:
        assert (out == 0).all(), "an empty call's output is zeros"
    torch.testing.assert_close(out.double(), truth_out, **tol)
    if returns == "lse":
        assert lse.shape == (batch, H, tq) and lse.dtype == torch.float32
        if tk == 0 and name != "sinks":
            assert torch.isneginf(lse).all(), "no keys: LSE −inf"
        torch.testing.assert_close(lse.double(), truth_lse, **(tol if not empty else
                                                              dict(rtol=1e-6, atol=1e-6)))
    if returns == "weights":
        assert weights.shape == (batch, H, tq, tk)
        torch.testing.assert_close(weights.double(), truth_weights, **tol)
    assert grads is not None and truth_grads is not None
    assert len(grads) == len(truth_grads)
    for got, want in zip(grads, truth_grads):
        assert got is not None and got.shape == want.shape
        if empty and not (name == "sinks" and got.dim() == 1):
            assert (got == 0).all(), "an empty call's gradients are zeros"
        torch.testing.assert_close(got.double(), want.double(),
                                   **(tol if not empty else dict(rtol=1e-6, atol=1e-6)))


# ---- empty calls ---------------------------------------------------------------------------------

@pytest.mark.parametrize("returns", ["out", "lse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_Tq{}_Tk{}".format(*s))
@pytest.mark.parametrize("name", MASKS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_calls_on_every_backend(backend, name, shape, dtype, returns, monkeypatch):
    """Empty calls give empty outputs (zeros and LSE −inf for rows without keys; with sinks,
    what the reference gives) and zero gradients of the right shapes for q, k, v and learnable
    slopes, tables, biases and sink logits; a backend refuses one only for what it refuses in
    the same call with work to do (a softcap on torch, a learnable bias on triton, …)."""
    _prepare(backend, monkeypatch)
    if _refuses(backend, dtype, name, returns):
        with pytest.raises(ValueError, match=f"not supported by {backend}"):
            _call(backend, dtype, name, shape, returns)
        return
    _check_against_reference(backend, dtype, name, shape, returns)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_Tq{}_Tk{}".format(*s))
@pytest.mark.parametrize("name", ["none", "causal", "alibi_learned", "relative_learned", "sinks",
                                  "softcap", "documents_causal"])
@pytest.mark.parametrize("backend", ["reference", "tiled", "auto"])
def test_empty_calls_return_weights(backend, name, shape):
    """``return_weights=True``: ``[B, H, Tq, Tk]`` weights (zeros where a row has no keys),
    without autograd on tiled (which refuses weights with a graph, empty or not)."""
    if backend == "tiled":
        with torch.no_grad():
            batch, tq, tk = shape
            q, k, v = _qkv(batch, tq, tk, torch.float32)
            mask, _ = _mask(name, batch, tq, tk, _leaves())
            got = ak.attention(q, k, v, mask, backend="tiled", return_weights=True)
            q, k, v = _qkv(batch, tq, tk, torch.float64)
            mask, _ = _mask(name, batch, tq, tk, _leaves(torch.float64))
            truth = ak.attention(q, k, v, mask, backend="reference", return_weights=True)
        assert got.weights.shape == (batch, H, tq, tk)
        torch.testing.assert_close(got.weights.double(), truth.weights, rtol=1e-5, atol=1e-5)
        return
    _check_against_reference(backend, torch.float32, name, shape, "weights")


def test_empty_calls_keep_honest_refusals():
    """An empty call still meets a backend's refusals that have nothing to do with its size,
    each with its reason; the torch backend names no empty sequence among them."""
    q, k, v = (t.detach() for t in _qkv(2, 3, 0, torch.float32))
    with pytest.raises(ValueError, match=r"softcap \(not supported by torch\)"):
        ak.attention(q, k, v, ak.softcap(3.0), backend="torch")
    with pytest.raises(ValueError, match=r"dtype=torch.float64 \(not supported by triton\)"):
        ak.attention(q.double(), k.double(), v.double(), backend="triton")
    with pytest.raises(ValueError, match=r"dropout_p=0.5 \(not supported by torch\)"):
        ak.attention(q, k, v, dropout_p=0.5, backend="torch")
    inputs = validate(q, k, v)
    assert not any("empty" in r for r in dispatch.BACKENDS["torch"].not_supported_reasons(inputs))


def test_empty_position_vector():
    """ALiBi and relative biases over Tq = Tk = 0: an empty position vector ``[1, H, 0]``."""
    space = ak.masks.MaskSpace(batch=2, heads=H, q_len=0, kv_len=0)
    _, modifiers = ak.modifiers.split(ak.alibi(torch.ones(H)) & ak.relative_bias(torch.ones(H, 8)))
    assert modifiers.position_bias(space, torch.float32).shape == (1, H, 0)


# ---- score functions must name their dims -------------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "tiled"])
@pytest.mark.parametrize("result, shape", [
    (lambda s, b, h, i, j: 0.1 * i.flatten(), r"\(6,\)"),  # [tq]: it would lie over the keys
    (lambda s, b, h, i, j: s[0] + j.flatten(), r"\(4, \d, \d\)"),  # tiled's probe: (4, 1, 1)
    (lambda s, b, h, i, j: (i - j)[0, 0].float(), r"\(6, 6\)"),
])
def test_score_function_result_needs_named_dims(backend, result, shape):
    """A score function's result broadcasts to ``[B|1, H|1, tq|1, tk|1]`` by its own four dims
    (or is a constant): a ``[tq]`` result, which plain broadcasting would lay over the keys,
    is refused with the shape got and the shape expected."""
    q, k, v = (t.detach() for t in _qkv(2, 6, 6, torch.float32))
    with pytest.raises(ValueError, match=r"returned shape " + shape
                       + r".*\[B\|1, H\|1, tq\|1, tk\|1\] = \[2, 4, "):
        ak.attention(q, k, v, ak.score_function(result), backend=backend)


def test_score_function_results_that_broadcast_by_their_dims():
    """Four dims of sizes 1 or the named ones, or a constant of any rank: accepted."""
    q, k, v = (t.detach() for t in _qkv(2, 6, 5, torch.float32))
    plain = ak.attention(q, k, v, backend="reference")
    for fn in (lambda s, b, h, i, j: s + 0 * i,  # [1, 1, tq, 1]
               lambda s, b, h, i, j: s + torch.ones(1),
               lambda s, b, h, i, j: torch.zeros(()) + s):
        for backend in ("reference", "tiled"):
            torch.testing.assert_close(ak.attention(q, k, v, ak.score_function(fn),
                                                    backend=backend), plain)


# ---- relative-bias bucket ids -------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "tiled", "torch", "triton", "auto"])
@pytest.mark.parametrize("buckets, got", [
    (lambda r: r, r"-4"),  # negative ids would wrap around to the table's last columns
    (lambda r: r + 4, r"8"),  # one past the last bucket
    (lambda r: r + 100, r"96, 104"),
])
def test_relative_bucket_ids_outside_the_table(backend, buckets, got, monkeypatch):
    """Bucket ids are checked once per call, against ``[0, num_buckets)``, whichever backend
    runs it; the message names the range and the ids got."""
    _prepare(backend, monkeypatch)
    q, k, v = (t.detach() for t in _qkv(1, 5, 5, torch.float32))
    mask = ak.relative_bias(torch.zeros(H, 8), buckets=buckets)
    with pytest.raises(ValueError, match=rf"bucket ids in \[{got}|bucket ids .*{got}"):
        ak.attention(q, k, v, mask, backend=backend)
    with pytest.raises(ValueError, match=r"\[0, num_buckets\) = \[0, 8\)"):
        ak.attention(q, k, v, mask, backend=backend)


def test_relative_bucket_ids_checked_once_per_call(monkeypatch):
    """The bucket function runs a bounded number of times per call, never once per tile."""
    calls = []

    def buckets(r):
        calls.append(tuple(r.shape))
        return r.clamp(-3, 4) + 3

    q, k, v = (t.detach() for t in _qkv(1, 700, 700, torch.float32))
    mask = ak.causal() & ak.relative_bias(torch.randn(H, 8), buckets=buckets) & ak.softcap(4.0)
    for backend in ("tiled", "reference"):
        calls.clear()
        ak.attention(q, k, v, mask, backend=backend)
        assert len(calls) <= 2, calls


def test_relative_bias_table_without_buckets():
    with pytest.raises(ValueError, match=r"relative_bias\(table\) has 0 buckets"):
        ak.relative_bias(torch.zeros(H, 0), buckets=lambda r: r.clamp(0, 0))
    with pytest.raises(ValueError, match=r"relative_bias\(table\) has 0 buckets"):
        ak.relative_bias(torch.zeros(H, 0))


# ---- softcap values ------------------------------------------------------------------------------

TINY = torch.finfo(torch.float32).tiny  # float32's smallest normal number, 1.18e-38
HUGE = torch.finfo(torch.float32).max


@pytest.mark.parametrize("cap, error, words", [
    (1e-39, ValueError, r"float32's normal range"),  # tiled gave NaN here
    (3e-39, ValueError, r"float32's normal range"),
    (TINY / 2, ValueError, r"float32's normal range"),
    (3.5e38, ValueError, r"float32's normal range"),  # overflows float32: tiled and triton NaN
    (1e300, ValueError, r"float32's normal range"),
    (float("nan"), ValueError, r"cap must be a finite float > 0"),
    (float("inf"), ValueError, r"cap must be a finite float > 0"),
    (-1.0, ValueError, r"cap must be a finite float > 0"),
    (0.0, ValueError, r"cap must be a finite float > 0"),
    (0, ValueError, r"cap must be a finite float > 0"),
    (True, TypeError, r"cap must be a float"),
    ("30", TypeError, r"cap must be a float"),
    (None, TypeError, r"cap must be a float"),
])
def test_softcap_refuses_caps_float32_cannot_carry(cap, error, words):
    with pytest.raises(error, match=words):
        ak.softcap(cap)


@pytest.mark.parametrize("scale", [None, 1000.0])
@pytest.mark.parametrize("cap", [TINY, 2e-38, 1e-30])
def test_tiny_softcaps_stay_finite_with_large_scores(cap, scale):
    """|scale|/cap far past float32's range: the scores are divided by the cap after the
    matmul, since q·(scale/cap) would overflow to inf and the matmul give NaN."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (10 * torch.randn(1, 2, 65, 19, generator=gen) for _ in range(3))
    got = ak.attention(q, k, v, ak.softcap(cap), scale=scale, backend="tiled")
    truth = ak.attention(q.double(), k.double(), v.double(), ak.softcap(cap), scale=scale,
                         backend="reference")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), truth, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cap", [TINY, 1e-30, 30.0, 1e30, HUGE])
@pytest.mark.parametrize("backend", ["tiled", "auto"])
def test_softcap_at_the_ends_of_its_range_is_finite(cap, backend):
    """Caps from float32's smallest normal number to its largest run finite on float32 and
    agree with the float64 reference."""
    q, k, v = _qkv(1, 9, 9, torch.float32)
    got = ak.attention(q, k, v, ak.causal() & ak.softcap(cap), backend=backend)
    dq, = torch.autograd.grad(got.sum(), q)
    assert torch.isfinite(got).all() and torch.isfinite(dq).all()
    truth = ak.attention(*(t.detach().double() for t in (q, k, v)), ak.causal() & ak.softcap(cap),
                         backend="reference")
    torch.testing.assert_close(got.detach().double(), truth, rtol=1e-5, atol=1e-5)


def test_the_torch_backend_shares_its_whole_mask_with_the_non_finite_scan(monkeypatch):
    """torch's dense bias evaluates the whole mask: the scan reads that one evaluation at any
    batch, not a second chunked one."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(65, 1, 256, 4, generator=gen) for _ in range(3))
    ids = torch.randint(0, 3, (65, 256), generator=gen)
    function = ak.from_function(lambda b, h, i, j: ids[b, i] == ids[b, j])
    mask = function & ak.padding(kv_lengths=torch.randint(1, 257, (65,), generator=gen))
    evaluated = []
    original = type(function).tile

    def tile(self, *args):
        allowed = original(self, *args)
        evaluated.append(allowed.numel())
        return allowed
    monkeypatch.setattr(type(function), "tile", tile)
    out = ak.attention(q, k, v, mask, backend="torch")
    assert sum(evaluated) == 65 * 256 * 256 and out.isfinite().all()


@pytest.mark.parametrize("kind", ["documents", "window & padding", "causal & padding",
                                  "function of b"])
def test_the_non_finite_scan_never_evaluates_the_whole_batch_mask(kind, monkeypatch):
    """B·Tq·Tk above the scan's chunk: the rows that may see a NaN key are found by runs or
    row chunks over the batch, never by the call's whole [B, 1, Tq, Tk] mask (5 bytes per
    entry), and still exactly."""
    from attnkit import finite
    from attnkit.inputs import Inputs

    def whole(self):
        raise AssertionError("the whole batch's mask was evaluated")
    monkeypatch.setattr(Inputs, "allowed", whole)
    monkeypatch.setattr(Inputs, "has_key", whole)
    gen = torch.Generator().manual_seed(3)
    batch, length = 20, 512
    assert batch * length * length > finite.CHUNK_ELEMENTS
    q, k, v = (torch.randn(batch, 1, length, 4, generator=gen) for _ in range(3))
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = {"documents": ak.documents(torch.arange(length).repeat(batch, 1) // 100
                                      + torch.arange(batch)[:, None] % 3),
            "window & padding": ak.sliding_window(8) & ak.padding(kv_lengths=lengths),
            "causal & padding": ak.causal() & ak.padding(lengths, lengths),
            "function of b": ak.from_function(lambda b, h, i, j: j < lengths[b])}[kind]
    if kind == "function of b":  # no runs: row chunks of at most CHUNK_ELEMENTS entries
        largest, scanning = [], []
        original, scan = type(mask).tile, finite._scan

        def tile(self, *args):
            allowed = original(self, *args)
            if scanning:
                largest.append(allowed.numel())
            return allowed

        def scan_(*args):
            scanning.append(True)
            try:
                return scan(*args)
            finally:
                scanning.clear()
        monkeypatch.setattr(type(mask), "tile", tile)
        monkeypatch.setattr(finite, "_scan", scan_)
    k[3, 0, 250] = float("nan")  # rows that may see it are NaN, no other
    got = ak.attention(q, k, v, mask, backend="tiled")
    want = ak.attention(q.double(), k.double(), v.double(), mask, backend="reference")
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got.nan_to_num(), want.float().nan_to_num())
    if kind == "function of b":
        assert max(largest) <= finite.CHUNK_ELEMENTS


def test_a_nan_key_first_in_a_short_chunk_reaches_its_row():
    """A 4-token chunk over a cache: the chunk's diagonal square is short, and its first row
    sees one of its keys, NaN: that row is NaN too, not the other keys' result."""
    gen = torch.Generator().manual_seed(10)
    q = torch.randn(1, 1, 4, 8, generator=gen)
    k, v = (torch.randn(1, 1, 600, 8, generator=gen) for _ in range(2))
    k[0, 0, 596, 0] = float("nan")
    got = ak.attention(q, k, v, ak.causal("bottom_right"), backend="tiled")
    assert got.isnan().all()


@pytest.mark.parametrize("case", ["window", "left padding"])
def test_a_nan_key_alone_past_a_block_boundary_reaches_the_row(case):
    """A decoding step (keys not scanned) whose newest key, NaN, sits alone in its key
    segment: the row is NaN (torch's fused kernel alone would give out 0, LSE 0 for it)."""
    gen = torch.Generator().manual_seed(9)
    kv_len = 513 if case == "window" else 129
    q = torch.randn(2, 4, 1, 8, generator=gen)
    k, v = (torch.randn(2, 2, kv_len, 8, generator=gen) for _ in range(2))
    k[0, 0, -1, 0] = float("nan")
    mask = (ak.sliding_window(100, align="bottom_right") if case == "window"
            else ak.padding(kv_starts=[3, 3]))
    got = ak.attention(q, k, v, mask, backend="tiled", return_lse=True)
    want = ak.attention(q.double(), k.double(), v.double(), mask, backend="reference")
    assert torch.equal(got.out.isnan(), want.isnan()) and got.out[0, :2].isnan().all()
    assert got.lse[0, :2].isnan().all()
    torch.testing.assert_close(got.out[1], want[1].float())


@pytest.mark.parametrize("backend", ["torch", "tiled", "auto"])
@pytest.mark.parametrize("mask", [ak.causal(), ak.sliding_window(2),
                                  ak.padding(kv_lengths=torch.tensor([5, 7]))])
def test_overlapping_keys_and_values_with_the_lse(backend, mask):
    """K and V whose rows overlap in memory (``unfold``, ``as_strided``; a zero stride over
    the batch): zeroing the keys no query sees returns tensors whose last dim is strided,
    which torch's fused kernel (the LSE's path) must not get as they are."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(400, generator=gen)
    q = torch.randn(2, 4, 6, 8, generator=gen)
    for k_strides, v_strides in (((3, 5, 1, 1), (7, 11, 2, 1)), ((0, 9, 1, 1), (1, 2, 1, 1))):
        k = base.as_strided((2, 4, 7, 8), k_strides)
        v = base[50:].as_strided((2, 4, 7, 8), v_strides)
        with torch.no_grad():
            got = ak.attention(q, k, v, mask=mask, backend=backend, return_lse=True)
        truth = ak.attention(q.double(), k.double(), v.double(), mask=mask,
                             backend="reference", return_lse=True)
        torch.testing.assert_close(got.out.double(), truth.out, rtol=0, atol=1e-5)
        torch.testing.assert_close(got.lse.double(), truth.lse, rtol=0, atol=1e-5)


def _overlapping_queries(gen: torch.Generator) -> dict:
    """Query layouts whose rows overlap or repeat: torch's kernels make their output like q,
    in an order that may put the last dim outside, and write it as if it were inside."""
    return {
        "unfold": torch.randn(1, 1, 9, generator=gen).unfold(-1, 8, 1),  # [1, 1, 2, 8]
        "expand over positions": torch.randn(3, 1, 1, 2, generator=gen).expand(3, 1, 5, 2),
        "overlapping rows": torch.randn(200, generator=gen).as_strided((2, 2, 16, 8),
                                                                       (40, 17, 2, 1)),
        "decode, batch stride 1": torch.randn(100, generator=gen).as_strided((2, 2, 1, 8),
                                                                             (1, 9, 8, 1)),
    }


@pytest.mark.parametrize("backend", ["torch", "tiled", "auto"])
@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("mask", [None, ak.causal("bottom_right")])
def test_overlapping_queries(backend, return_lse, mask):
    gen = torch.Generator().manual_seed(0)
    for name, q in _overlapping_queries(gen).items():
        k, v = (torch.randn(q.shape[0], q.shape[1], 40, q.shape[-1], generator=gen)
                for _ in range(2))
        got = ak.attention(q, k, v, mask, backend=backend, return_lse=return_lse)
        truth = ak.attention(q.double(), k.double(), v.double(), mask, backend="reference",
                             return_lse=return_lse)
        if return_lse:
            torch.testing.assert_close(got.lse.double(), truth.lse, rtol=0, atol=1e-5, msg=name)
            got, truth = got.out, truth.out
        torch.testing.assert_close(got.double(), truth, rtol=0, atol=1e-5, msg=name)


def test_overlapping_queries_get_their_gradients():
    """The tiled backward makes dQ (and dK, dV) like q (and K, V) through torch's kernel."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(200, generator=gen).requires_grad_()
    q = base.as_strided((2, 2, 16, 8), (40, 17, 2, 1))
    k, v = (torch.randn(2, 2, 16, 8, generator=gen).requires_grad_() for _ in range(2))
    got = torch.autograd.grad(ak.attention(q, k, v, ak.causal(), backend="tiled").sum(),
                              (base, k, v))
    leaves = [t.detach().double().requires_grad_() for t in (base, k, v)]
    truth = ak.attention(leaves[0].as_strided(q.shape, q.stride()), *leaves[1:], ak.causal(),
                         backend="reference")
    for g, w in zip(got, torch.autograd.grad(truth.sum(), leaves)):
        torch.testing.assert_close(g.double(), w, rtol=0, atol=1e-5)


@pytest.mark.parametrize("which", ["k", "v"])
def test_position_biases_over_overlapping_keys(which):
    """ALiBi on tiled with K or V from ``unfold``: the reversed K/V of its fused path (a
    flip) come back with a strided last dim, which torch's kernel must not get."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 7, 4, generator=gen)
    tensors = {name: torch.randn(1, 2, 3, 4, generator=gen) for name in "kv"}
    tensors[which] = torch.randn(1, 2, 6, generator=gen).unfold(-1, 4, 1)  # [1, 2, 3, 4]
    mask = ak.alibi(torch.tensor([0.5, 0.25, 0.125, 0.0625]))
    got = ak.attention(q, tensors["k"], tensors["v"], mask, backend="tiled")
    truth = ak.attention(q.double(), tensors["k"].double(), tensors["v"].double(), mask,
                         backend="reference")
    torch.testing.assert_close(got.double(), truth, rtol=0, atol=1e-5)


def test_negative_views_into_a_cache_and_additive_attention():
    """A ``torch._neg_view`` K or V where nn zeroes padding (a cache's append with lengths,
    AdditiveAttention with a padding mask) reads as the values it holds."""
    from attnkit.nn import AdditiveAttention, KVCache

    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(2, 1, 4, 8, generator=gen) for _ in range(2))
    lengths = torch.tensor([2, 4])
    cache = KVCache.empty().append(torch._neg_view(k), v, lengths=lengths)
    plain = KVCache.empty().append(-k, v, lengths=lengths)
    assert torch.equal(cache.keys, plain.keys) and torch.equal(cache.values, plain.values)
    module = AdditiveAttention(8, 8, 16)
    q, keys = torch.randn(2, 3, 8, generator=gen), torch.randn(2, 4, 8, generator=gen)
    values = torch.randn(2, 4, 8, generator=gen)
    mask = ak.padding(kv_lengths=lengths)
    with torch.no_grad():
        got = module(q, keys, torch._neg_view(values), mask=mask)
        want = module(q, keys, -values, mask=mask)
    for a, b in zip(got, want):  # (context, weights)
        assert torch.equal(a, b)
