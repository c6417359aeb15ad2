"""Sizes at and around the thresholds where attnkit switches paths, on every CPU backend.

attnkit picks its path by size in many places: the tiled engine's key blocks (``BLOCK_K``),
its query blocks (``FUSED_BLOCK_Q``, ``choose_block_q`` from ``TILE_ELEMENTS``), its fused
kernel's shortest segment (``FUSED_MIN_KEYS``), the sliding-window staircases and strips,
the fixed schedule's key blocks and splits (``FIXED_BLOCK_K``, ``KV_SPLIT``) and widest head
dim (``INVARIANT_MAX_HEAD_DIM``); the torch backend's stacked GQA heads of a decoding step
(``_stacks_heads``) and per-sequence calls (``SEQUENCE_MAX_QUERIES``,
``SEQUENCE_MIN_ELEMENTS``); ``auto``'s dense-mask limit (``DENSE_MAX_SCORES``) and position
biases (``POSITION_BIAS_QUERIES``); :mod:`attnkit.finite`'s key checks (``KV_CHECK_MIN_ROWS``,
``KV_CHECK_MAX_ELEMENTS``); triton's decoding kernel (``DECODE_MAX_QUERIES``, the 4×-keys
rule). Each test here runs sizes one below, at and one above such a threshold.

Forward, LSE and gradients are compared with float64 math written out here (softcap, ALiBi
and sinks included) by the 2× rule of ``conftest.assert_within_2x``; masks are the hand-built
dense forms of ``conftest``. Non-finite inputs follow docs/NUMERICS.md: a row that holds or
may attend a NaN is NaN, the other batch elements and K/V head groups keep their bits, and
garbage outside each sequence's real keys changes nothing.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from conftest import (assert_within_2x, dense_band, error_floor, import_triton_interpreted,
                      max_error, sorted_ids)

if importlib.util.find_spec("triton") is not None:
    import_triton_interpreted()

import attnkit as ak  # noqa: E402
from attnkit.backends import torch_sdpa  # noqa: E402
from attnkit.backends.tiled import plan as tiled_plan  # noqa: E402
from attnkit.masks import DENSE_MAX_SCORES  # noqa: E402

CPU_BACKENDS = ("tiled", "torch", "auto")


# ---- the math, written out ------------------------------------------------------------------

def _math(q, k, v, allowed, bias, scale, dtype, cap=None, slopes=None, sink=None):
    """``(out, lse, weights)`` of softmax(cap·tanh(q·kᵀ·scale / cap) + alibi + bias,
    masked)·v in ``dtype``, joined with per-head ``sink`` logits; fully masked rows out 0 (LSE −inf, or the
    sink). q ``[B, Hq, Tq, Dk]``, k/v ``[B, Hkv, Tk, D]``; ``allowed``/``bias`` broadcast to
    ``[B, Hq, Tq, Tk]``; ``slopes``/``sink`` ``[Hq]``."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, Hq, Tq, Tk]
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    tq, tk = scores.shape[-2:]
    if slopes is not None:
        distance = (torch.arange(tk)[None, :] - torch.arange(tq)[:, None]).to(dtype)
        scores = scores + slopes.to(dtype)[:, None, None] * distance
    if bias is not None:
        scores = scores + bias.to(dtype)
    if allowed is None:
        allowed = torch.ones(scores.shape, dtype=torch.bool)
    allowed = allowed.expand(scores.shape)
    empty = ~allowed.any(-1, keepdim=True)
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(empty, 0.0)
    weights = torch.softmax(scores, -1).masked_fill(empty, 0.0)
    lse = torch.logsumexp(scores, -1).masked_fill(empty[..., 0], float("-inf"))
    if sink is not None:
        joined = torch.logaddexp(lse, sink.to(dtype)[:, None].expand_as(lse))
        weights = weights * torch.exp(lse - joined)[..., None]
        lse = joined
    return weights @ v, lse, weights


def _band(tq: int, tk: int, left=None, right=None, align: str = "top_left") -> torch.Tensor:
    """``[Tq, Tk]``: key j allowed for query i when ``i + s − left ≤ j ≤ i + s + right``
    (``s = Tk − Tq`` bottom-right, else 0; ``None``: unbounded). ``conftest.dense_band``
    as one expression: these sizes are too many for its loops."""
    shift = tk - tq if align == "bottom_right" else 0
    offset = torch.arange(tk)[None, :] - torch.arange(tq)[:, None] - shift  # j − i − s
    allowed = torch.ones(tq, tk, dtype=torch.bool)
    if right is not None:
        allowed &= offset <= right
    if left is not None:
        allowed &= offset >= -left
    return allowed


def _padding(tq: int, tk: int, q_lengths, kv_lengths, batch: int) -> torch.Tensor:
    """``[B, 1, Tq, Tk]``: query i and key j of element b real below its lengths
    (``conftest.dense_padding`` as one expression)."""
    q_real = torch.arange(tq)[None, :] < torch.tensor(q_lengths or [tq] * batch)[:, None]
    kv_real = torch.arange(tk)[None, :] < torch.tensor(kv_lengths)[:, None]
    return (q_real[:, None, :, None] & kv_real[:, None, None, :])


def _mask(kind: str, batch: int, heads: int, tq: int, tk: int, gen):
    """``(mask, allowed, bias)``: the mask to pass, its dense bool form broadcastable to
    ``[B, H, Tq, Tk]`` (``None``: every key) and its bias values (``None``)."""
    if kind == "none":
        return None, None, None
    if kind == "causal":
        return ak.causal(), _band(tq, tk, None, 0), None
    if kind == "causal_br":
        return ak.causal("bottom_right"), _band(tq, tk, None, 0, "bottom_right"), None
    if kind.startswith("window"):
        left = int(kind[len("window"):])
        return ak.sliding_window(left), _band(tq, tk, left, 0), None
    if kind == "padding":  # ragged, a sequence without keys, and one full
        q_lengths = [int(x) for x in torch.randint(1, tq + 1, (batch,), generator=gen)]
        kv_lengths = [int(x) for x in torch.randint(0, tk + 1, (batch,), generator=gen)]
        kv_lengths[0], q_lengths[-1], kv_lengths[-1] = 0, tq, tk
        return (ak.padding(q_lengths=q_lengths, kv_lengths=kv_lengths),
                _padding(tq, tk, q_lengths, kv_lengths, batch), None)
    if kind == "kvpad":  # keys alone, ragged
        lengths = [int(x) for x in torch.randint(1, tk, (batch,), generator=gen)]
        return (ak.padding(kv_lengths=lengths), _padding(tq, tk, None, lengths, batch),
                None)
    if kind == "documents":
        q_ids = sorted_ids(tq, 3, gen)
        kv_ids = q_ids if tq == tk else sorted_ids(tk, 3, gen)
        return ak.documents(q_ids, kv_ids), q_ids[:, None] == kv_ids[None, :], None
    if kind == "bool":
        allowed = torch.rand(batch, heads, tq, tk, generator=gen) < 0.6
        return allowed, allowed, None
    if kind == "bias":  # per head, learnable
        values = torch.randn(heads, tq, tk, generator=gen, dtype=torch.float64).float()
        return ak.bias(values.requires_grad_()), None, values
    if kind == "float":  # a raw float tensor: a bias whose −inf entries are masked
        values = torch.randn(batch, 1, tq, tk, generator=gen, dtype=torch.float64)
        values[torch.rand(batch, 1, tq, tk, generator=gen) < 0.3] = float("-inf")
        values = values.float()
        return values, ~torch.isneginf(values), torch.nan_to_num(values, neginf=0.0)
    raise KeyError(kind)


def _modifiers(names, heads: int, gen):
    """``(masks to & with the call's mask, math keywords, learnable tensors)``."""
    parts, math_kw, tensors = [], {}, []
    if "softcap" in names:
        parts.append(ak.softcap(5.0))
        math_kw["cap"] = 5.0
    if "alibi" in names:
        slopes = torch.rand(heads, generator=gen, dtype=torch.float64).float()
        parts.append(ak.alibi(slopes))
        math_kw["slopes"] = slopes
    if "sinks" in names:
        logits = torch.randn(heads, generator=gen, dtype=torch.float64).float().requires_grad_()
        parts.append(ak.sinks(logits))
        math_kw["sink"] = logits
        tensors.append(logits)
    return parts, math_kw, tensors


def _compare(backend, shape, dtype, kind, mods=(), grads=True, invariant=None, seed=0):
    """One call of ``backend`` against the float64 math by the 2× rule: out, LSE and (with
    ``grads``) dq, dk, dv, a bias's and the sinks' gradients. ``shape``: ``(B, Hq, Hkv, Tq,
    Tk, Dk, Dv)``."""
    batch, heads, heads_kv, tq, tk, dk, dv = shape
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype) for s in
               ((batch, heads, tq, dk), (batch, heads_kv, tk, dk), (batch, heads_kv, tk, dv)))
    mask, allowed, bias = _mask(kind, batch, heads, tq, tk, gen)
    parts, math_kw, tensors = _modifiers(mods, heads, gen)
    for part in parts:  # (the kinds run with modifiers are mask objects)
        mask = part if mask is None else mask & part
    learnable = tensors + ([bias] if bias is not None and bias.requires_grad else [])
    scale = dk ** -0.5
    keywords = {} if invariant is None else {"invariant": invariant}
    leaves = [t.detach().requires_grad_(grads) for t in (q, k, v)]
    with torch.no_grad():
        result = ak.attention(q, k, v, mask, backend=backend, return_lse=True, **keywords)
    truth_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, *learnable)]
    plain_leaves = [t.detach().to(dtype if t.dim() == 4 else t.dtype).clone().requires_grad_()
                    for t in (q, k, v, *learnable)]

    def math_of(leaves_, in_dtype):
        kw = dict(math_kw)
        if "sink" in kw:
            kw["sink"] = leaves_[3]
        use_bias = leaves_[-1] if bias is not None and bias.requires_grad else bias
        return _math(*leaves_[:3], allowed, use_bias, scale, in_dtype, **kw)

    out_true, lse_true, weights = math_of(truth_leaves, torch.float64)
    out_plain, lse_plain, _ = math_of(plain_leaves, dtype)
    where = f"{backend} {shape} {dtype} {kind} {mods}"
    assert_within_2x(f"out of {where}", result.out, out_true, out_plain, dtype)
    assert torch.equal(torch.isneginf(result.lse), torch.isneginf(lse_true)), where
    assert_within_2x(f"lse of {where}", result.lse, lse_true, lse_plain, dtype)
    if not grads:
        return
    dout = torch.randn(out_true.shape, generator=gen, dtype=torch.float64)
    out = ak.attention(*leaves, mask, backend=backend, **keywords)
    got = torch.autograd.grad(out, leaves + learnable, dout.to(dtype))
    true = torch.autograd.grad(out_true, truth_leaves, dout)
    plain = torch.autograd.grad(out_plain, plain_leaves, dout.to(dtype))
    floors = _delta_floors(q, k, v, dout, weights.detach(), out_true.detach(), scale)
    for name, g, t, p in zip(("dq", "dk", "dv", "dsink/dbias", "dbias"), got, true, plain):
        assert torch.isfinite(g).all(), f"{name} of {where}: NaN/inf"
        assert_within_2x(f"{name} of {where}", g, t, p, dtype, floors.get(name, 0.0))


def _delta_floors(q, k, v, dout, weights, out, scale) -> dict:
    """``conftest.delta_form_floors`` from the float64 ``weights`` and ``out`` of
    :func:`_math` (softcap, ALiBi and sinks included): four float32 ulps of ``|dp| + |Δ|``
    per score, carried by ``|k|`` into dq and ``|q|`` into dk, added in quadrature."""
    q, k, v, dout = (t.detach().double() for t in (q, k, v, dout))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    dp = dout @ v.transpose(-1, -2)
    delta = (dout * out).sum(-1, keepdim=True)
    term = (weights * (dp.abs() + delta.abs()) * scale) ** 2
    dq = (term @ k ** 2).sqrt()
    dk = (term.transpose(-1, -2) @ q ** 2).unflatten(1, (-1, group)).sum(2).sqrt()
    ulps = 4 * torch.finfo(torch.float32).eps
    return {"dq": ulps * float(dq.max()) if dq.numel() else 0.0,
            "dk": ulps * float(dk.max()) if dk.numel() else 0.0}


# ---- forward, LSE and gradients at the tiled engine's and torch's size rules ---------------------

# (Tq, Tk): FUSED_MIN_KEYS (16) and BLOCK_K (128) in the keys, torch's stacked heads (Tq 1),
# FUSED_BLOCK_Q (256) in the queries, DENSE_MAX_SCORES (2^16 = 256 × 256) for auto
SIZES = ((1, 15), (1, 16), (1, 17), (4, 16), (17, 15), (3, 127), (3, 129), (127, 128),
         (129, 144), (255, 256), (256, 257), (257, 255))
MASKS = ("none", "causal", "causal_br", "window3", "padding", "documents", "bool", "float",
         "bias")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("tq,tk", SIZES)
def test_block_crossings(backend, tq, tk):
    """Every mask at the key-block and query-block crossings, GQA, float32 (the fused
    kernel's tiles) and float16 (the matmul path)."""
    for i, kind in enumerate(MASKS):
        if backend == "torch" and kind == "bias":
            continue  # a learnable bias: refused there
        dtype = torch.float16 if i % 3 == 2 else torch.float32
        _compare(backend, (2, 4, 2, tq, tk, 4, 4), dtype, kind, seed=tq * 1000 + tk + i)


@pytest.mark.parametrize("tq,tk,modifiers", [
    (1, 15, ("sinks",)), (4, 16, ("alibi",)), (5, 17, ("alibi",)), (16, 15, ("softcap",)),
    (3, 129, ("softcap", "alibi", "sinks")), (129, 144, ("alibi", "sinks")),
    (256, 257, ("softcap",))])
@pytest.mark.parametrize("kind", ("none", "causal_br", "padding", "bias"))
def test_modifier_crossings(tq, tk, modifiers, kind):
    """Softcap, ALiBi and sinks (auto's POSITION_BIAS_QUERIES = 4 for ALiBi without a mask;
    the matmul path's MODIFIED_TILE_KEYS for softcap) on tiled and auto, float32 and
    float16."""
    for backend, dtype in (("tiled", torch.float32), ("auto", torch.float16)):
        _compare(backend, (2, 4, 2, tq, tk, 4, 4), dtype, kind, modifiers, seed=tq + tk)


@pytest.mark.parametrize("tk", (2048, 2049))
def test_tile_elements_crossing(tk):
    """``choose_block_q`` at its smallest block (16 rows for 64 heads × 2048 keys) and a
    partial segment cut at ``TILE_ELEMENTS`` scores (the 17th key block), matmul path (Dk ≠
    Dv) and fused kernel."""
    assert tiled_plan.choose_block_q(64, 2048) == 16
    for i, kind in enumerate(("bool", "causal_br", "padding")):
        _compare("tiled", (1, 64, 32, 17, tk, 2, 3), torch.float32, kind, seed=tk + i)
        _compare("tiled", (1, 64, 64, 17, tk, 1, 1), torch.float32, kind, grads=False,
                 seed=tk + i)


@pytest.mark.parametrize("window", (63, 64, 65, 255, 256, 257, 1023, 1024, 1025))
def test_window_staircase_crossings(window):
    """Sliding windows at the staircase's widest merge (``staircase_max_keys`` 1024), the
    fused kernel's block (256) and triangle strips (64)."""
    _compare("tiled", (1, 1, 1, 1100, 1100, 2, 2), torch.float32, f"window{window}",
             seed=window)


@pytest.mark.parametrize("tq,tk", ((1, 255), (4, 257), (5, 511), (255, 512), (257, 513)))
def test_invariant_block_crossings(tq, tk):
    """The fixed schedule (``invariant=True``) at its key blocks (FIXED_BLOCK_K 256), the
    fused kernel's splits (KV_SPLIT 512) and row multiples, against the math."""
    for i, kind in enumerate(("causal_br", "padding", "documents", "bias")):
        dtype = torch.float16 if i == 2 else torch.float32
        _compare("tiled", (2, 2, 1, tq, tk, 8, 8), dtype, kind, grads=tq < 100,
                 invariant=True, seed=tq + tk + i)


def test_invariant_head_dim_limit():
    """``INVARIANT_MAX_HEAD_DIM``: 256 runs under the contract, 257 is refused by tiled with
    the limit named, and by auto with every backend's reason."""
    limit = tiled_plan.INVARIANT_MAX_HEAD_DIM
    _compare("tiled", (1, 2, 1, 5, 40, limit, limit), torch.float32, "causal", invariant=True)
    q = torch.zeros(1, 2, 5, limit + 1)
    k = torch.zeros(1, 1, 40, limit + 1)
    with pytest.raises(ValueError, match=f"head dim {limit + 1} > {limit}"):
        ak.attention(q, k, k, ak.causal(), backend="tiled", invariant=True)
    with pytest.raises(ValueError, match="no backend can run these inputs"):
        ak.attention(q, k, k, ak.causal(), invariant=True)


@pytest.mark.parametrize("tq,tk", ((256, 256), (256, 257)))
def test_auto_dense_limit(tq, tk):
    """auto takes torch for a mask up to DENSE_MAX_SCORES scores, tiled past it; both agree
    with the math."""
    q = torch.zeros(1, 1, tq, 4)
    k = torch.zeros(1, 1, tk, 4)
    picked = ak.explain_dispatch(q, k, k, ak.sliding_window(3)).backend
    assert picked == ("torch" if tq * tk <= DENSE_MAX_SCORES else "tiled")
    _compare("auto", (1, 2, 1, tq, tk, 4, 4), torch.float32, "window3", seed=tk)


# ---- non-finite values on both sides of the key checks ------------------------------------------

def _allowed(kind, batch, heads, tq, tk, gen):
    mask, allowed, _ = _mask(kind, batch, heads, tq, tk, gen)
    if allowed is None:
        allowed = torch.ones(tq, tk, dtype=torch.bool)
    return mask, allowed.expand(batch, heads, tq, tk)


def _keys_looked_at(query_rows: int, key_elements: int) -> bool:
    """docs/NUMERICS.md: CPU calls of at least 64 query rows or with K of at most 4,096
    elements look at their keys for non-finite values."""
    return query_rows >= 64 or key_elements <= 4096


def _poisoned(backend, shape, kind, where, value=float("nan"), seed=0):
    """Run ``backend`` clean and with ``value`` written at ``where`` (``("q", b, h, i)``, a
    query; ``("k", b, h, j)``, a key row of K/V head h; ``("v", b, h, j)``; ``("unseen",)``,
    every K/V head's row of a key no query of the call may see) and check the contract: the
    rows that hold or may attend it NaN in out and LSE, every row outside the batch element
    and K/V head group it sits in with the clean run's bits, fully masked rows 0. A key no
    query sees changes no row where :mod:`attnkit.finite` looks at the keys or the mask gives
    each sequence its run of real keys."""
    batch, heads, heads_kv, tq, tk, dim = shape
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*s, generator=gen, dtype=torch.float64).float() for s in
               ((batch, heads, tq, dim), (batch, heads_kv, tk, dim), (batch, heads_kv, tk, dim)))
    mask, allowed = _allowed(kind, batch, heads, tq, tk, gen)
    has_key = allowed.any(-1)
    clean = ak.attention(q, k, v, mask, backend=backend, return_lse=True)
    group = heads // heads_kv
    must = torch.zeros(batch, heads, tq, dtype=torch.bool)
    may = torch.zeros(batch, heads, tq, dtype=torch.bool)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    if where[0] == "q":
        _, b, h, i = where
        q2[b, h, i, 0] = value
        must[b, h, i] = may[b, h, i] = has_key[b, h, i]
    elif where[0] in ("k", "v"):
        _, b, h, j = where
        (k2 if where[0] == "k" else v2)[b, h, j, 0] = value
        heads_of = slice(h * group, (h + 1) * group)
        must[b, heads_of] = allowed[b, heads_of, :, j]
        may[b, heads_of] = has_key[b, heads_of]  # a partial tile may spread it (0 · NaN)
    else:
        unseen = (~allowed.any(2).any(1)).nonzero()  # [n, 2]: (b, j)
        assert len(unseen), "the case needs a key no query sees"
        b, j = unseen[len(unseen) // 2].tolist()
        k2[b, :, j, 0] = value
        runs = kind in ("padding", "kvpad")
        if not runs and not _keys_looked_at(tq, k.numel()):
            may[b] = has_key[b]
    result = ak.attention(q2, k2, v2, mask, backend=backend, return_lse=True)
    label = f"{backend} {shape} {kind} {where}"
    assert result.out.isnan().any(-1)[must].all(), f"{label}: a row that sees it is not NaN"
    assert result.lse.isnan()[must].all(), f"{label}: an LSE that sees it is not NaN"
    same_out = ((result.out == clean.out) | (result.out.isnan() & clean.out.isnan())).all(-1)
    same_lse = (result.lse == clean.lse) | (result.lse.isnan() & clean.lse.isnan())
    assert same_out[~may].all(), f"{label}: a row that cannot see it changed"
    assert same_lse[~may].all(), f"{label}: an LSE that cannot see it changed"
    assert (result.out[~has_key] == 0).all(), f"{label}: a fully masked row is not 0"


# (B, Hq, Hkv, Tq, Tk, D): KV_CHECK_MIN_ROWS (64) with K of 4,800 elements; KV_CHECK_MAX_ELEMENTS
# (4,096) with 5 query rows
KV_CHECKS = ((2, 4, 2, 63, 300, 4), (2, 4, 2, 64, 300, 4), (2, 4, 2, 65, 300, 4),
             (2, 4, 2, 5, 255, 4), (2, 4, 2, 5, 256, 4), (2, 4, 2, 5, 257, 4))


@pytest.mark.parametrize("shape", KV_CHECKS)
@pytest.mark.parametrize("kind", ("causal", "window3", "padding", "documents", "bool"))
def test_non_finite_at_kv_check_thresholds(shape, kind):
    batch, heads, heads_kv, tq, tk, _ = shape
    for n, backend in enumerate(CPU_BACKENDS):
        for where in (("q", batch - 1, heads - 1, tq // 2), ("k", batch - 1, heads_kv - 1, tk // 3),
                      ("v", batch - 1, 0, tk - 1), ("k", 0, 0, 0), ("unseen",)):
            if where == ("unseen",) and kind in ("window3", "bool", "documents"):
                continue  # every key seen (or not known to be unseen)
            _poisoned(backend, shape, kind, where, seed=n + tq + tk)
        if _keys_looked_at(tq, batch * heads_kv * tk * shape[-1]):
            # an infinite key reaches as NaN only where the keys are looked at
            for sign in (1, -1):
                _poisoned(backend, shape, kind, ("k", batch - 1, heads_kv - 1, tk // 3),
                          sign * float("inf"), seed=n)


@pytest.mark.parametrize("tq,tk", ((16, 4095), (16, 4096), (17, 4096)))
def test_non_finite_at_sequence_spans(tq, tk):
    """The torch backend's per-sequence calls (at most SEQUENCE_MAX_QUERIES queries over at
    least SEQUENCE_MIN_ELEMENTS K elements per sequence, a key padding): NaN in the padding
    never reaches a row, NaN inside a sequence's keys reaches its rows, on both sides."""
    assert (torch_sdpa.SEQUENCE_MAX_QUERIES, torch_sdpa.SEQUENCE_MIN_ELEMENTS) == (16, 1 << 16)
    shape = (2, 2, 1, tq, tk, 16)
    for backend in ("torch", "auto"):
        for where in (("unseen",), ("k", 1, 0, 5), ("q", 0, 1, 3)):
            _poisoned(backend, shape, "kvpad", where, seed=tk)


# ---- triton's decoding kernel, interpreted -------------------------------------------------------

@pytest.mark.parametrize("heads,heads_kv,tq,tk", [(4, 1, 16, 64), (4, 1, 16, 63), (4, 1, 17, 68),
                                                  (32, 1, 2, 8), (33, 1, 2, 8)])
def test_triton_decode_crossings(monkeypatch, heads, heads_kv, tq, tk):
    """The split-key decoding kernel (at most DECODE_MAX_QUERIES = 16 queries, 64 query rows
    per K/V head, keys at least 4× the queries) and the forward kernel past each limit."""
    from conftest import interpreted_triton_launch
    launch = interpreted_triton_launch()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert (launch.DECODE_MAX_QUERIES, launch.DECODE_MAX_ROWS) == (16, 64)
    _compare("triton", (2, heads, heads_kv, tq, tk, 16, 16), torch.float32, "kvpad",
             grads=False, seed=tq + tk + heads)


def test_float64_math_matches_reference():
    """The math above is the reference's (a check of the test's own yardstick)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    slopes, sink = torch.rand(4, generator=gen), torch.randn(4, generator=gen)
    mask = ak.causal() & ak.softcap(5.0) & ak.alibi(slopes) & ak.sinks(sink)
    got = ak.attention(q, k, v, mask, backend="reference", return_lse=True)
    out, lse, _ = _math(q, k, v, dense_band(9, 9, None, 0), None, 0.5, torch.float64,
                        cap=5.0, slopes=slopes, sink=sink)
    assert max_error(got.out, out) <= error_floor(torch.float64, out)
    assert max_error(got.lse, lse) <= error_floor(torch.float64, lse)
