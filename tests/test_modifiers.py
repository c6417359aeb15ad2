"""Score modifiers (softcap, alibi, relative_bias, sinks, score_function) against an independent
float64 definition written out here: alone and with masks, GQA, Tq ≠ Tk, fully masked rows,
every backend that runs them (forward, backward, the modifiers' own gradients), the tiled
engine with many small tiles, gradcheck, T5's buckets, errors, dispatch, the call cache, memory.
"""

from __future__ import annotations

import collections
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnkit as ak
from attnkit import dispatch
from attnkit.backends.tiled import TiledOptions, tiled_attention
from attnkit.inputs import validate

from conftest import assert_within_2x, dense_band, dense_causal, dense_documents, dense_padding, sorted_ids

B, H, HKV, TQ, TK, D = 2, 4, 2, 37, 53, 16
SCALE = 0.5  # larger than 1/sqrt(D): scores reach the softcaps


# ---- the independent definition -----------------------------------------------------------------

def distances(tq: int, tk: int, shift: int = 0) -> torch.Tensor:
    """``[tq, tk]``: ``j − i − shift`` (key minus query), by loops."""
    return torch.tensor([[j - i - shift for j in range(tk)] for i in range(tq)], dtype=torch.float64)


def modified_attention(q, k, v, *, dtype, scale=SCALE, allowed=None, bias=None, cap=None,
                       alibi=None, relative=None, fn=None, sink=None):
    """softmax(modified scores) v in ``dtype``, as the modifiers' definition reads: scale →
    ``cap·tanh(s/cap)`` → + ``bias`` + ALiBi (``(slopes [H] or [B, H], distances [Tq, Tk])``)
    + relative (``(table [H, nb], bucket ids [Tq, Tk])``) → ``fn(s, b, h, i, j)`` → −inf where
    not ``allowed`` → softmax with ``exp(sink_h)`` in the denominator. → ``(out, lse, weights)``;
    a fully masked row: out 0, lse −inf (or sink_h), zero weights."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [B, H, Tk, D]
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, H, Tq, Tk]
    batch, heads, tq, tk = scores.shape
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    if bias is not None:
        scores = scores + bias.to(dtype)
    if alibi is not None:
        slopes, dist = alibi
        slopes = slopes.to(dtype)
        slopes = slopes[None, :, None, None] if slopes.dim() == 1 else slopes[:, :, None, None]
        scores = scores + slopes * dist.to(dtype)
    if relative is not None:
        table, ids = relative
        scores = scores + table.to(dtype)[:, ids][None]
    if fn is not None:
        scores = fn(scores, torch.arange(batch)[:, None, None, None],
                    torch.arange(heads)[None, :, None, None], torch.arange(tq)[None, None, :, None],
                    torch.arange(tk)[None, None, None, :]).to(dtype)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if sink is not None:
        column = sink.to(dtype)[None, :, None, None].expand(batch, heads, tq, 1)
        full = torch.cat([scores, column], -1)
        weights = torch.softmax(full, -1)[..., :-1]
        lse = torch.logsumexp(full, -1)
    else:
        empty = torch.isneginf(scores).all(-1, keepdim=True)  # [B, H, Tq, 1]
        safe = scores.masked_fill(empty, 0.0)
        weights = torch.softmax(safe, -1).masked_fill(empty, 0.0)
        lse = torch.logsumexp(safe, -1).masked_fill(empty[..., 0], float("-inf"))
    return weights @ v, lse, weights


def t5_bucket(relative: int, num_buckets: int, bidirectional: bool = True,
              max_distance: int = 128) -> int:
    """T5's bucket of one relative position (key − query), from the paper's description: half
    the buckets per direction (bidirectional), the first half of those exact distances, then
    log-spaced up to ``max_distance``, the last bucket beyond."""
    per_side = num_buckets // 2 if bidirectional else num_buckets
    offset = per_side if bidirectional and relative > 0 else 0
    distance = abs(relative) if bidirectional else max(-relative, 0)
    exact = per_side // 2
    if distance < exact:
        return offset + distance
    far = exact + int(math.log(distance / exact) / math.log(max_distance / exact) * (per_side - exact))
    return offset + min(far, per_side - 1)


# ---- the cases ------------------------------------------------------------------------------------

def _rand(gen, *shape, low=None, high=None):
    x = torch.rand(*shape, generator=gen, dtype=torch.float64) if low is not None else \
        torch.randn(*shape, generator=gen, dtype=torch.float64)
    return x * (high - low) + low if low is not None else x


CASES = ["softcap", "softcap&causal", "alibi&causal", "alibi_bottom_right", "alibi&documents",
         "relative&padding", "relative_custom&window", "sinks", "sinks&padding",
         "score_function&causal", "everything"]


def make_case(name: str, gen: torch.Generator, batch=B, heads=H, tq=TQ, tk=TK,
              dtype=torch.float32, slope_scale=1.0):
    """``(mask, truth kwargs, params)``: the attnkit mask, what :func:`modified_attention`
    needs for the same computation (the params themselves, in ``dtype``, for gradients), and
    the modifiers' tensors that require grad. ``"positions&bias"``: causal & ALiBi & T5
    relative & a bias. ``slope_scale`` multiplies the ALiBi slopes (drawn in [0.05, 0.5])."""
    params, truth = [], {}

    def param(t):
        t = t.to(dtype).requires_grad_()
        params.append(t)
        return t

    parts = []
    allowed = None
    together = name == "positions&bias"
    if ("causal" in name and "bottom_right" not in name) or together:
        parts.append(ak.causal())
        allowed = dense_causal(tq, tk)
    if name == "alibi_bottom_right":
        parts.append(ak.causal("bottom_right"))
        allowed = dense_causal(tq, tk, "bottom_right")
    if "documents" in name or name == "everything":
        q_ids, kv_ids = sorted_ids(tq, 3, gen), sorted_ids(tk, 3, gen)
        parts.append(ak.documents(q_ids, kv_ids))
        allowed = dense_documents(q_ids, kv_ids)
    if "padding" in name:  # batch 0 has no key at all: every row of it is fully masked
        q_lengths, kv_lengths = [tq, max(1, tq - 10)], [0, max(1, tk - 20)]
        parts.append(ak.padding(q_lengths=q_lengths, kv_lengths=kv_lengths))
        allowed = dense_padding(tq, tk, q_lengths, kv_lengths, batch)
    if "window" in name:
        parts.append(ak.sliding_window(5, 2))
        allowed = dense_band(tq, tk, 5, 2)
    if name == "everything" or together:
        values = param(_rand(gen, tq, tk) * 0.5)
        parts.append(ak.bias(values))
        truth["bias"] = values
    if name.startswith("softcap") or name == "everything":
        parts.append(ak.softcap(1.5))
        truth["cap"] = 1.5
    if name.startswith("alibi") or name == "everything" or together:
        low, high = 0.05 * slope_scale, 0.5 * slope_scale
        if name == "alibi_bottom_right":
            slopes = param(_rand(gen, batch, heads, low=low, high=high))
            parts.append(ak.alibi(slopes, "bottom_right"))
            truth["alibi"] = (slopes, distances(tq, tk, tk - tq))
        else:
            slopes = param(_rand(gen, heads, low=low, high=high))
            parts.append(ak.alibi(slopes))
            truth["alibi"] = (slopes, distances(tq, tk))
    if name.startswith("relative") or name == "everything" or together:
        rel = distances(tq, tk).long()
        if "custom" in name:
            table = param(_rand(gen, heads, 9))
            parts.append(ak.relative_bias(table, buckets=lambda r: r.clamp(-4, 4) + 4))
            ids = torch.tensor([[min(max(int(r), -4), 4) + 4 for r in row] for row in rel.tolist()])
        else:
            table = param(_rand(gen, heads, 16))
            parts.append(ak.relative_bias(table))
            ids = torch.tensor([[t5_bucket(r, 16) for r in row] for row in rel.tolist()])
        truth["relative"] = (table, ids)
    if name.startswith("score_function") or name == "everything":
        weight = param(_rand(gen, heads) * 0.5)

        def wobble(score, b, h, q_idx, kv_idx):
            return score + weight[h] * torch.cos(score) - 0.01 * (q_idx - kv_idx)
        parts.append(ak.score_function(wobble))
        truth["fn"] = wobble
    if name.startswith("sinks") or name == "everything":
        logits = param(_rand(gen, heads))
        parts.append(ak.sinks(logits))
        truth["sink"] = logits
    mask = parts[0]
    for part in parts[1:]:
        mask = mask & part
    truth["allowed"] = allowed
    return mask, truth, params


def make_qkv(gen, dtype=torch.float32, batch=B, heads=H, heads_kv=HKV, tq=TQ, tk=TK, d=D):
    return [torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype) for shape in
            ((batch, heads, tq, d), (batch, heads_kv, tk, d), (batch, heads_kv, tk, d))]


def expected(q, k, v, truth, params, cotangent, dtype, with_lse=True):
    """``(out, lse, grads of q, k, v, *params)`` of :func:`modified_attention` in ``dtype``
    (float64: the truth; the inputs' dtype: plain math, the yardstick of the 2x rule), for the
    loss ``Σ out·cotangent + Σ lse·cot_lse`` on finite LSEs (without ``with_lse``: ``Σ
    out·cotangent``)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse, _ = modified_attention(*leaves, dtype=dtype, **truth)
    grads = torch.autograd.grad(_loss(out, lse, cotangent, with_lse), [*leaves, *params],
                                allow_unused=True)
    return out, lse, grads


def _loss(out, lse, cotangent, with_lse=True):
    loss = (out.double() * cotangent).sum()
    if not with_lse:
        return loss
    lse_cot = torch.linspace(-1, 1, lse.numel(), dtype=torch.float64).reshape(lse.shape)
    finite = torch.where(torch.isfinite(lse), lse.double(), 0.0)
    return loss + (finite * lse_cot).sum()


def assert_like_truth(out, lse, grads, q, k, v, truth, params, cotangent, with_lse=True,
                      floors=None):
    """``out``, ``lse`` and the gradients of (q, k, v, *params) within the 2x rule of plain
    math in q's dtype against the float64 truth (for :func:`_loss` ``with_lse``); fully
    masked rows exact. ``floors``: an error floor per param (by position in ``params``)."""
    dtype = q.dtype
    t_out, t_lse, t_grads = expected(q, k, v, truth, params, cotangent, torch.float64, with_lse)
    p_out, p_lse, p_grads = expected(q, k, v, truth, params, cotangent, dtype, with_lse)
    assert out.dtype == dtype
    assert_within_2x("out", out, t_out, p_out, dtype)
    assert_within_2x("lse", lse, t_lse, p_lse, dtype)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(t_lse)), "−inf LSE exactly on empty rows"
    assert (out[torch.isneginf(t_lse)] == 0).all()
    names = ["dq", "dk", "dv"] + [f"d{tuple(p.shape)}" for p in params]
    floor = [0.0] * 3 + [(floors or {}).get(i, 0.0) for i in range(len(params))]
    for name, g, tg, pg, f in zip(names, grads, t_grads, p_grads, floor):
        assert g is not None and torch.isfinite(g).all(), name
        assert_within_2x(name, g, tg, pg, dtype, f)


def position_floors(q, k, v, truth, params, cotangent) -> dict:
    """Error floors for the ALiBi slopes' and relative tables' gradients (loss ``Σ
    out·cotangent``) from the backward's Δ form, as ``delta_form_floors`` does for dq/dk: four
    float32 ulps of ``p·(|dp| + |Δ|)`` per score (with ``p`` recomputed from an LSE, a row's dS
    need not sum to exactly 0 as autograd's softmax backward makes it), carried by the
    distance ``j − i`` into a slope and summed per bucket into a table entry, in quadrature.
    ``{index in params: floor}``. In float64."""
    with torch.no_grad():
        out, _, weights = modified_attention(q, k, v, dtype=torch.float64, **truth)
    group = q.shape[1] // k.shape[1]
    dp = cotangent @ v.double().repeat_interleave(group, 1).transpose(-1, -2)  # [B, H, Tq, Tk]
    delta = (cotangent * out).sum(-1, keepdim=True)  # [B, H, Tq, 1]
    term = 4 * torch.finfo(torch.float32).eps * weights * (dp.abs() + delta.abs())
    floors = {}
    if "alibi" in truth:
        slopes, dist = truth["alibi"]
        per_head = ((term * dist) ** 2).sum((2, 3) if slopes.dim() == 2 else (0, 2, 3)).sqrt()
        floors[next(i for i, p in enumerate(params) if p is slopes)] = float(per_head.max())
    if "relative" in truth:
        table, ids = truth["relative"]
        one_hot = torch.nn.functional.one_hot(ids, table.shape[-1]).double()  # [Tq, Tk, nb]
        per_entry = torch.einsum("bhij,ijn->hn", term ** 2, one_hot).sqrt()
        floors[next(i for i, p in enumerate(params) if p is table)] = float(per_entry.max())
    return floors


def _cotangent(shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


# ---- T5 buckets -----------------------------------------------------------------------------------

def test_t5_buckets_by_reasoning():
    """num_buckets=32, bidirectional: 16 per side, distances 0..7 exact, then bucket
    8 + floor(2·log2(d/8)) (log base 16 over 8 buckets), capped at 15; keys after the query
    add 16. Unidirectional: 32 buckets, 0..15 exact, then 16 + floor(16·log2(d/16)/3) (log
    base 8 over 16 buckets), keys after the query all 0."""
    rel = torch.tensor([0, -3, 3, -7, -8, -9, -11, -12, -16, -20, -32, -64, -127, -128, -1000,
                        1000, 8, 16])
    assert ak.t5_buckets(rel, 32).tolist() == [0, 3, 19, 7, 8, 8, 8, 9, 10, 10, 12, 14, 15, 15,
                                               15, 31, 24, 26]
    assert ak.t5_buckets(rel, 32, bidirectional=False).tolist() == [
        0, 3, 0, 7, 8, 9, 11, 12, 16, 17, 21, 26, 31, 31, 31, 0, 0, 0]
    everything = torch.arange(-300, 300)
    for nb, bidirectional, far in ((32, True, 128), (16, True, 40), (12, False, 50)):
        got = ak.t5_buckets(everything.reshape(3, -1), nb, bidirectional, far).flatten().tolist()
        assert got == [t5_bucket(r, nb, bidirectional, far) for r in everything.tolist()]
        assert min(got) == 0 and max(got) < nb


def test_t5_buckets_agree_with_transformers():
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    rel = torch.arange(-1000, 1001)
    for nb, bidirectional, far in ((32, True, 128), (8, False, 20), (33, True, 64), (4, True, 8)):
        theirs = t5.T5Attention._relative_position_bucket(rel, bidirectional=bidirectional,
                                                           num_buckets=nb, max_distance=far)
        assert torch.equal(ak.t5_buckets(rel, nb, bidirectional, far), theirs)


def test_t5_buckets_errors():
    with pytest.raises(TypeError, match="integer tensor"):
        ak.t5_buckets(torch.zeros(3), 32)
    with pytest.raises(ValueError, match="at least 4"):
        ak.t5_buckets(torch.zeros(3, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="max_distance"):
        ak.t5_buckets(torch.zeros(3, dtype=torch.long), 32, max_distance=8)


# ---- the tiled engine, many small tiles --------------------------------------------------------------

@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name", CASES)
def test_tiled_engine_small_tiles(name, fused, gen):
    """Blocks of 16 queries × 8 keys: many tiles, segments at key offsets, ragged tails; ALiBi
    and relative biases alone go through the fused kernel when the options ask for it, any
    other modifier takes the matmul path (the fused kernel cannot apply it); sinks are joined
    as attention() joins them."""
    q, k, v = make_qkv(gen)
    mask, truth, params = make_case(name, gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    inputs = validate(*leaves, mask, scale=SCALE)
    mods = inputs.modifiers
    out, lse = tiled_attention(*leaves, inputs.mask, scale=SCALE, modifiers=mods, block_q=16,
                               block_k=8, options=TiledOptions(fused_tiles=fused))
    assert out.grad_fn.problem.plan.fused == (fused and (not mods.changes_scores
                                                         or mods.by_position))
    if mods.sinks is not None:
        out, lse, _ = mods.sinks.join(out, lse)
    cotangent = _cotangent(out.shape)
    grads = torch.autograd.grad(_loss(out, lse, cotangent), [*leaves, *params])
    assert_like_truth(out, lse, grads, q, k, v, truth, params, cotangent)


# ---- ALiBi and relative biases on the fused kernel ---------------------------------------------------

class OpCounter(TorchDispatchMode):
    """How many times each aten operator ran while active, by name."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


FUSED_FORWARD = "_scaled_dot_product_flash_attention_for_cpu"
FUSED_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward"

POSITION_CASES = [("alibi", 1.0), ("alibi&causal", 1.0), ("alibi&causal", 8.0),
                  ("alibi_bottom_right", 1.0), ("alibi_bottom_right", 8.0), ("alibi&documents", 1.0),
                  ("relative&padding", 1.0), ("relative_custom&window", 1.0),
                  ("positions&bias", 1.0)]
LAYOUTS = {"gqa": (HKV, 64), "strips": (H, 4), "squares": (H, 16)}


@pytest.mark.parametrize("learned", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name,slope_scale", POSITION_CASES)
def test_position_biases_on_the_fused_kernel(name, slope_scale, layout, learned, gen):
    """ALiBi and relative biases alone go through torch's fused kernel, the bias of each tile
    read from one vector by relative position: segments without element mask with their keys
    reversed (one call per query head of a GQA group), strips of a staircase (``strips``: 4
    rows), whole causal squares (``squares``: 16 rows, under two strips), additive tiles
    (documents, padding with fully masked rows, a window, a bias), Tq ≠ Tk top-left and
    bottom-right, [H] and [B, H] slopes. Forward and backward (of out) within the 2x rule.

    The backward runs torch's fused kernel for fixed slopes and tables whose values span
    little; the matmul path, which sums dS along diagonals for the vector's gradient, for
    learned ones, and for slopes ×8 (values spanning more than WIDE_BIAS, where the fused
    backward meets subnormal weights)."""
    heads_kv, strip = LAYOUTS[layout]
    q, k, v = make_qkv(gen, heads_kv=heads_kv)
    mask, truth, params = make_case(name, gen, slope_scale=slope_scale)
    if not learned:
        for t in params:
            t.requires_grad_(False)
        params = []
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    inputs = validate(*leaves, mask, scale=SCALE)
    assert inputs.modifiers.by_position
    with OpCounter() as ops:
        out, lse = tiled_attention(*leaves, inputs.mask, scale=SCALE, modifiers=inputs.modifiers,
                                   block_q=16, block_k=8,
                                   options=TiledOptions(triangle_strip=strip))
        forward = ops.counts[FUSED_FORWARD]
        cotangent = _cotangent(out.shape)
        grads = torch.autograd.grad(_loss(out, lse, cotangent, with_lse=False), [*leaves, *params])
    assert out.grad_fn.problem.plan.fused and forward > 0
    assert (ops.counts[FUSED_BACKWARD] > 0) == (not learned and slope_scale == 1.0)
    floors = position_floors(q, k, v, truth, params, cotangent) if learned else None
    assert_like_truth(out, lse, grads, q, k, v, truth, params, cotangent, with_lse=False,
                      floors=floors)


def test_position_vector_matches_the_tiles(gen):
    """``Modifiers.position_bias`` holds, at ``j − i + Tq − 1``, what the per-tile definitions
    give: ALiBi with [H] and [B, H] slopes, top-left and bottom-right, T5 and custom buckets,
    summed."""
    space = ak.masks.MaskSpace(batch=2, heads=3, q_len=7, kv_len=11)
    clamped = ak.relative_bias(_rand(gen, 3, 5), buckets=lambda r: r.clamp(-2, 2) + 2)
    mask = (ak.alibi(_rand(gen, 3)) & ak.alibi(_rand(gen, 2, 3), "bottom_right")
            & ak.relative_bias(_rand(gen, 3, 8)) & clamped)
    _, modifiers = ak.modifiers.split(mask)
    vector = modifiers.position_bias(space, torch.float64)  # [B, H, Tq + Tk − 1]
    assert vector.shape == (2, 3, 7 + 11 - 1)
    q_idx, kv_idx = torch.arange(7), torch.arange(11)
    tile = sum(part.values(q_idx, kv_idx, space, torch.float64)
               for part in (*modifiers.alibi, *modifiers.relative))  # [B, H, Tq, Tk]
    index = kv_idx[None, :] - q_idx[:, None] + 7 - 1
    torch.testing.assert_close(vector[..., index], tile, rtol=1e-14, atol=1e-14)


def test_attention_with_alibi_takes_the_fused_kernel(gen):
    """Through attention() (auto: tiled on CPU float32), causal & ALiBi with fixed slopes runs
    the fused kernel forward and backward, GQA and Tq ≠ Tk included, within the 2x rule."""
    q, k, v = make_qkv(gen)
    mask, truth, params = make_case("alibi&causal", gen)
    for t in params:
        t.requires_grad_(False)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    assert ak.explain_dispatch(*leaves, mask).backend == "tiled"
    with OpCounter() as ops:
        out = ak.attention(*leaves, mask, scale=SCALE)
        cotangent = _cotangent(out.shape)
        grads = torch.autograd.grad(_loss(out, None, cotangent, with_lse=False), leaves)
    assert ops.counts[FUSED_FORWARD] > 0 and ops.counts[FUSED_BACKWARD] > 0
    lse = ak.attention(q, k, v, mask, scale=SCALE, return_lse=True).lse
    assert_like_truth(out, lse, grads, q, k, v, truth, [], cotangent, with_lse=False)


# ---- every backend that runs them, through attention() ---------------------------------------------

BACKENDS = [name for name, b in dispatch.BACKENDS.items() if b.is_available()]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CASES)
def test_backends_forward_backward(backend, name, gen):
    q, k, v = make_qkv(gen)
    mask, truth, params = make_case(name, gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    reasons = dispatch.BACKENDS[backend].not_supported_reasons(
        validate(*leaves, mask, scale=SCALE, need_lse=True))
    if reasons:
        pytest.skip(f"{backend}: " + "; ".join(reasons))
    result = ak.attention(*leaves, mask, scale=SCALE, backend=backend, return_lse=True)
    cotangent = _cotangent(result.out.shape)
    grads = torch.autograd.grad(_loss(result.out, result.lse, cotangent), [*leaves, *params])
    assert_like_truth(result.out, result.lse, grads, q, k, v, truth, params, cotangent)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tiled_low_precision(dtype, gen):
    q, k, v = make_qkv(gen, dtype)
    mask, truth, params = make_case("everything", gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    result = ak.attention(*leaves, mask, scale=SCALE, backend="tiled", return_lse=True)
    cotangent = _cotangent(result.out.shape)
    grads = torch.autograd.grad(_loss(result.out, result.lse, cotangent), [*leaves, *params])
    assert_like_truth(result.out, result.lse, grads, q, k, v, truth, params, cotangent)


def test_fully_masked_rows_with_and_without_a_sink(gen):
    """Batch 0 sees no key: with a sink its rows are out 0 and LSE sink_h, all weight on the
    sink, gradients finite (and dsink = 1 per such row of the LSE's loss); without, LSE −inf."""
    q, k, v = make_qkv(gen)
    logits = torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True)
    pad = ak.padding(kv_lengths=[0, TK])
    for backend in ("reference", "tiled"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with_sink = ak.attention(*leaves, pad & ak.sinks(logits), backend=backend,
                                 return_lse=True, return_weights=backend == "reference")
        assert (with_sink.out[0] == 0).all()
        torch.testing.assert_close(with_sink.lse[0], logits.detach()[:, None].expand(H, TQ),
                                   rtol=0, atol=0)
        if with_sink.weights is not None:
            assert (with_sink.weights[0] == 0).all()
            assert (with_sink.weights[1].sum(-1) < 1).all()
        grads = torch.autograd.grad(with_sink.lse[0].sum() + with_sink.out.sum(),
                                    [*leaves, logits])
        assert all(torch.isfinite(g).all() for g in grads)
        assert (grads[0][0] == 0).all()
        plain = ak.attention(q, k, v, pad & ak.softcap(2.0), backend=backend, return_lse=True)
        assert torch.isneginf(plain.lse[0]).all() and (plain.out[0] == 0).all()


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_a_head_without_a_sink_keeps_zero_weights_on_a_row_with_no_key(backend, gen):
    """A sink logit of −inf (a head without one) on a fully masked row: weights 0, not
    exp(−inf − (−inf)) = NaN."""
    q, k, v = (torch.randn(1, 2, 3, 4, generator=gen) for _ in range(3))
    allowed = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    allowed[..., 1, :] = False
    r = ak.attention(q, k, v, ak.dense(allowed) & ak.sinks(torch.tensor([float("-inf"), 0.0])),
                     backend=backend, return_weights=True, return_lse=True)
    assert (r.weights[0, :, 1] == 0).all() and not torch.isnan(r.weights).any()


def test_sinks_on_torch_without_gradients(gen):
    """torch's kernel returns an LSE on CPU (Dk = Dv): sinks join its result."""
    q, k, v = make_qkv(gen)
    mask, truth, _ = make_case("sinks", gen)
    with torch.no_grad():
        assert ak.explain_dispatch(q, k, v, mask).backend == "torch"
        result = ak.attention(q, k, v, mask, scale=SCALE, backend="torch", return_lse=True)
    t_out, t_lse, _ = modified_attention(q, k, v, dtype=torch.float64, **truth)
    p_out, p_lse, _ = modified_attention(q, k, v, dtype=torch.float32, **truth)
    assert_within_2x("out", result.out, t_out, p_out, torch.float32)
    assert_within_2x("lse", result.lse, t_lse, p_lse, torch.float32)


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_weights_include_the_modifiers(backend, gen):
    q, k, v = make_qkv(gen)
    mask, truth, params = make_case("everything", gen)
    with torch.no_grad():
        result = ak.attention(q, k, v, mask, scale=SCALE, backend=backend, return_weights=True,
                              return_lse=True)
        _, _, t_weights = modified_attention(q, k, v, dtype=torch.float64, **truth)
        _, _, p_weights = modified_attention(q, k, v, dtype=torch.float32, **truth)
    assert_within_2x("weights", result.weights, t_weights, p_weights, torch.float32)
    # the sinks hold the rest of each row: exp(sink_h − lse) (all of it on rows with no key)
    on_sinks = torch.exp(truth["sink"].detach()[None, :, None] - result.lse)  # [B, H, Tq]
    torch.testing.assert_close(result.weights.sum(-1) + on_sinks, torch.ones_like(on_sinks))
    assert (on_sinks > 0).all()


# ---- gradcheck -----------------------------------------------------------------------------------

GRADCHECK_CASES = ["softcap&causal", "alibi_bottom_right", "relative&padding", "sinks&padding",
                   "score_function&causal", "everything"]


@pytest.mark.parametrize("backend", ["reference", "tiled"])
@pytest.mark.parametrize("name", GRADCHECK_CASES)
def test_gradcheck(backend, name, gen):
    q, k, v = (t.requires_grad_() for t in make_qkv(gen, torch.float64, batch=2, heads=2,
                                                         heads_kv=1, tq=4, tk=6, d=3))
    mask, _, params = make_case(name, gen, batch=2, heads=2, tq=4, tk=6, dtype=torch.float64)

    def fn(q, k, v, *params):
        result = ak.attention(q, k, v, mask, scale=SCALE, backend=backend, return_lse=True)
        return result.out, result.lse.masked_fill(torch.isneginf(result.lse), 0.0)

    assert torch.autograd.gradcheck(fn, (q, k, v, *params), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_double_backward_through_tiled_matches_reference(gen):
    q, k, v = (t.requires_grad_() for t in make_qkv(gen, torch.float64, batch=1, heads=2,
                                                         heads_kv=1, tq=5, tk=5, d=3))
    slopes = torch.tensor([0.3, 0.1], dtype=torch.float64, requires_grad=True)
    mask = ak.causal() & ak.softcap(1.0) & ak.alibi(slopes)
    penalties = []
    for backend in ("reference", "tiled"):
        out = ak.attention(q, k, v, mask, backend=backend)
        dq, dslopes = torch.autograd.grad(out.pow(2).sum(), (q, slopes), create_graph=True)
        penalties.append(torch.autograd.grad(dq.pow(2).sum() + dslopes.sum(), (k, slopes)))
    for a, b in zip(*penalties):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_torch_func_transforms_of_modifier_tensors(gen):
    """torch.func over the slopes / a batch of tables: wrapped tensors run on the reference."""
    q, k, v = make_qkv(gen, torch.float64, tq=5, tk=6)
    slopes = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    got = torch.func.grad(lambda s: ak.attention(q, k, v, ak.causal() & ak.alibi(s)).sum())(slopes)
    leaf = slopes.clone().requires_grad_()
    want, = torch.autograd.grad(ak.attention(q, k, v, ak.causal() & ak.alibi(leaf)).sum(), leaf)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    tables = torch.randn(3, H, 8, generator=gen, dtype=torch.float64)
    batched = torch.func.vmap(lambda t: ak.attention(q, k, v, ak.relative_bias(t)))(tables)
    for table, out in zip(tables, batched):
        torch.testing.assert_close(out, ak.attention(q, k, v, ak.relative_bias(table)))


# ---- score functions: what they read -------------------------------------------------------------

def test_score_function_gradient_reaches_non_leaf_and_listed_tensors(gen):
    """A closed-over tensor computed from a parameter passes its gradient on; a tensor the
    search cannot find (an attribute of a plain object) makes tiled refuse, so auto runs the
    reference; listed in ``tensors=``, tiled runs it."""
    q, k, v = make_qkv(gen, torch.float64, tq=6, tk=7)
    raw = torch.tensor([0.1, 0.2, -0.3, 0.4], dtype=torch.float64, requires_grad=True)
    derived = None  # a non-leaf, computed anew for each call below

    def by_closure(s, b, h, i, j):
        return s * derived[h]

    class Holder:
        pass
    holder = Holder()
    holder.weight = raw

    def by_attribute(s, b, h, i, j):
        return s * holder.weight.exp()[h]

    grads = {}
    for label, mask, backend in (
            ("closure", ak.score_function(by_closure), "tiled"),
            ("hidden", ak.score_function(by_attribute), "auto"),
            ("listed", ak.score_function(by_attribute, tensors=[holder.weight]), "tiled"),
            ("truth", ak.score_function(by_closure), "reference")):
        derived = raw.exp()
        if label == "hidden":
            assert ak.explain_dispatch(q, k, v, mask).backend == "reference"
            with pytest.raises(ValueError, match="score_function reading 1 tensor"):
                ak.attention(q, k, v, mask, backend="tiled")
        out = ak.attention(q, k, v, mask, backend=backend)
        grads[label], = torch.autograd.grad(out.sum(), raw)
    for label in ("closure", "hidden", "listed"):
        torch.testing.assert_close(grads[label], grads["truth"], rtol=1e-10, atol=1e-12)


def test_score_function_must_return_scores(gen):
    q, k, v = make_qkv(gen, tq=5, tk=5)
    for backend in ("reference", "tiled"):
        with pytest.raises(ValueError, match=r"returned shape \(3,\).*broadcast"):
            ak.attention(q, k, v, ak.score_function(lambda s, b, h, i, j: torch.zeros(3)),
                         backend=backend)
        with pytest.raises(TypeError, match="float tensor"):
            ak.attention(q, k, v, ak.score_function(lambda s, b, h, i, j: s > 0), backend=backend)
    # a broadcastable return value is fine: a constant shift changes nothing
    shifted = ak.attention(q, k, v, ak.score_function(lambda s, b, h, i, j: s + torch.ones(1)),
                           backend="tiled")
    torch.testing.assert_close(shifted, ak.attention(q, k, v))
    # scores ignored altogether: uniform weights, no gradient through the scores
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flat = ak.attention(*leaves, ak.score_function(lambda s, b, h, i, j: torch.zeros(1)),
                        backend="tiled")
    dq, dv = torch.autograd.grad(flat.sum(), (leaves[0], leaves[2]))
    torch.testing.assert_close(flat, v.mean(2, keepdim=True).repeat_interleave(2, 1).expand_as(flat))
    assert (dq == 0).all() and torch.allclose(dv, torch.full_like(dv, 2 * 5 / 5))


def test_additive_attention_refuses_modifiers():
    layer = ak.nn.AdditiveAttention(4, 4, 8)
    x = torch.randn(1, 3, 4)
    with pytest.raises(TypeError, match="score modifier"):
        layer(x, x, x, mask=ak.causal() & ak.softcap(2.0))


# ---- composition, errors --------------------------------------------------------------------------

def test_modifiers_never_skip_tiles_and_draw_as_everything():
    slopes = torch.ones(2)
    space = ak.masks.MaskSpace(batch=1, heads=2, q_len=64, kv_len=96)
    for modifier in (ak.softcap(3.0), ak.alibi(slopes), ak.relative_bias(torch.zeros(2, 8)),
                     ak.sinks(torch.zeros(2)), ak.score_function(lambda s, b, h, i, j: s)):
        assert (modifier.block_map(16, 32, space) == ak.masks.FULL).all()
        assert set(modifier.draw(4, 5)) <= {"█", "\n"}
        combined = ak.causal() & modifier
        assert torch.equal(combined.block_map(16, 32, space), ak.causal().block_map(16, 32, space))
        inputs = validate(torch.zeros(1, 2, 64, 4), torch.zeros(1, 2, 96, 4),
                          torch.zeros(1, 2, 96, 4), combined)
        assert inputs.mask.band() == ak.masks.CAUSAL  # the mask alone, the modifier split off
        assert inputs.modifiers.parts() == [modifier]


def test_or_and_not_with_a_modifier_raise_like_bias():
    slopes = torch.ones(2)
    for modifier in (ak.softcap(3.0), ak.alibi(slopes), ak.sinks(slopes)):
        with pytest.raises(TypeError, match=r"score modifier .* only be combined with &: '\|'"):
            ak.causal() | modifier
        with pytest.raises(TypeError, match=r"score modifier .* only be combined with &: '\|'"):
            (modifier & ak.causal()) | ak.sliding_window(2)
        with pytest.raises(TypeError, match=r"cannot be inverted with ~"):
            ~modifier
        with pytest.raises(TypeError, match=r"cannot be inverted with ~"):
            ~(ak.causal() & modifier)


def test_errors_name_shapes_and_fixes(gen):
    q, k, v = make_qkv(gen, batch=2, heads=4, heads_kv=2, tq=5, tk=5)
    cases = [
        (ak.alibi(torch.ones(2)), r"alibi slopes has shape \(2,\).*\[H\] or \[B, H\] = \[4\] or "
                                  r"\[2, 4\].*H counts query heads"),
        (ak.alibi(torch.ones(3, 4)), r"alibi slopes has shape \(3, 4\)"),
        (ak.relative_bias(torch.ones(2, 8)), r"relative_bias table has shape \(2, 8\).*H=4"),
        (ak.sinks(torch.ones(2, 4)), r"sinks logits has shape \(2, 4\).*\[H\] = \[4\]"),
        (ak.softcap(2.0) & ak.softcap(3.0), "2 softcap modifiers"),
    ]
    for mask, words in cases:
        with pytest.raises(ValueError, match=words) as error:
            ak.attention(q, k, v, mask)
        if "shape" in words:
            assert "q: shape (2, 4, 5, 16)" in str(error.value)  # every tensor's shape, as always
    constructors = [
        (lambda: ak.softcap(0.0), ValueError, "cap must be a finite float > 0"),
        (lambda: ak.softcap(float("inf")), ValueError, "cap must be a finite float > 0"),
        (lambda: ak.softcap(True), TypeError, "cap must be a float"),
        (lambda: ak.alibi(torch.ones(4, dtype=torch.long)), TypeError, "float tensor"),
        (lambda: ak.alibi(torch.ones(4), align="center"), ValueError, "top_left"),
        (lambda: ak.relative_bias(torch.ones(4)), ValueError, r"\[H, num_buckets\]"),
        (lambda: ak.relative_bias(torch.ones(4, 3)), ValueError, "at least 4"),
        (lambda: ak.relative_bias(torch.ones(4, 8), buckets=3), TypeError, "callable"),
        (lambda: ak.sinks([0.0]), TypeError, "float tensor"),
        (lambda: ak.score_function(3), TypeError, "callable"),
    ]
    for make, kind, words in constructors:
        with pytest.raises(kind, match=words):
            make()
    bad_buckets = ak.relative_bias(torch.ones(4, 8), buckets=lambda r: r.float())
    with pytest.raises(TypeError, match="long tensor"):
        ak.attention(q, k, v, bad_buckets, backend="tiled")


def test_compiled_region_refuses_modifiers_that_call_python(gen):
    from attnkit import compiled
    q, k, v = make_qkv(gen, tq=5, tk=5)
    for modifier, instead in (
            (ak.score_function(lambda s, b, h, i, j: s * 0.5), "softcap, alibi, relative_bias"),
            (ak.relative_bias(torch.ones(4, 8), buckets=lambda r: r.clamp(0, 7)), "buckets=None")):
        with pytest.raises(ValueError, match=f"calls Python code.*{instead}"):
            compiled.attention(q, k, v, ak.causal() & modifier, scale=None, dropout_p=0.0,
                               backend="auto", return_lse=False, return_weights=False)


# ---- dispatch -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CASES)
def test_auto_picks_a_backend_that_runs_it(name, gen):
    q, k, v = make_qkv(gen)
    mask, _, _ = make_case(name, gen)
    picked = ak.explain_dispatch(q, k, v, mask)
    assert picked.backend in ("tiled", "reference"), picked  # params require grad: not torch
    inputs = validate(q, k, v, mask)
    runs = {"triton": ("softcap", "alibi", "relative_bias"), "torch": ("alibi", "relative_bias")}
    for kind in inputs.modifiers.kinds():
        for backend in ("torch", "triton"):
            reasons = dispatch.BACKENDS[backend].not_supported_reasons(inputs)
            assert (f"{kind} (not supported by {backend})" in reasons) == (
                kind not in runs[backend]), (kind, backend, reasons)
    out = ak.attention(q, k, v, mask)
    torch.testing.assert_close(out, ak.attention(q, k, v, mask, backend="reference"),
                               rtol=1e-5, atol=1e-5)


def test_sinks_need_an_lse_with_gradients_from_torch(gen):
    q, k, v = make_qkv(gen)
    mask = ak.sinks(torch.zeros(H))
    reasons = dispatch.BACKENDS["torch"].not_supported_reasons(validate(q.requires_grad_(), k, v, mask))
    assert any("sinks" in r and "no gradient for the LSE" in r for r in reasons), reasons
    assert ak.explain_dispatch(q, k, v, mask).backend == "tiled"


POSITION_CASES = ["alibi&causal", "alibi_bottom_right", "alibi&documents", "relative&padding",
                  "relative_custom&window"]


@pytest.mark.parametrize("name", POSITION_CASES)
def test_torch_runs_constant_position_biases(name, gen):
    """The torch backend builds ALiBi and relative biases (constant slopes and tables) into
    its bias: out, LSE and q/k/v gradients within the 2x rule (GQA, Tq ≠ Tk, per-batch
    slopes, fully masked rows)."""
    q, k, v = make_qkv(gen)
    mask, truth, params = make_case(name, gen)
    for t in params:
        t.requires_grad_(False)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ak.attention(*leaves, mask, scale=SCALE, backend="torch")
    cotangent = _cotangent(out.shape)
    grads = torch.autograd.grad(_loss(out, None, cotangent, with_lse=False), leaves)
    lse = ak.attention(q, k, v, mask, scale=SCALE, backend="torch", return_lse=True).lse
    assert_like_truth(out, lse, grads, q, k, v, truth, [], cotangent, with_lse=False)


def test_auto_sends_decoding_steps_with_position_biases_to_torch(gen):
    """No mask and at most POSITION_BIAS_QUERIES queries (a decoding step): torch, which
    builds the small bias; more queries, a mask, or learnable slopes: tiled, with reasons."""
    from attnkit.backends.torch_sdpa import POSITION_BIAS_QUERIES

    slopes, table = torch.rand(H, generator=gen) * 0.5, torch.randn(H, 32, generator=gen)
    for modifier in (ak.alibi(slopes, "bottom_right"), ak.relative_bias(table),
                     ak.alibi(slopes, "bottom_right") & ak.sinks(torch.zeros(H))):
        q, k, v = make_qkv(gen, tq=1, tk=300)
        assert ak.explain_dispatch(q, k, v, ak.causal("bottom_right") & modifier).backend == "torch"
        torch.testing.assert_close(ak.attention(q, k, v, modifier),
                                   ak.attention(q, k, v, modifier, backend="reference"),
                                   rtol=1e-5, atol=1e-5)
        q, k, v = make_qkv(gen, tq=POSITION_BIAS_QUERIES + 1, tk=300)
        picked = ak.explain_dispatch(q, k, v, modifier)
        assert picked.backend == "tiled" and "materialised" in picked.reasons["torch"][0], picked
        picked = ak.explain_dispatch(q, k, v, ak.padding(kv_lengths=[200, 300]) & modifier)
        assert picked.backend == "tiled", picked
    q, k, v = make_qkv(gen, tq=1, tk=300)
    learned = ak.alibi(slopes.clone().requires_grad_())
    reasons = dispatch.BACKENDS["torch"].not_supported_reasons(validate(q, k, v, learned))
    assert any("require grad" in r for r in reasons), reasons
    with torch.no_grad():  # a model's learned slopes or table in a decoding step: constants
        for modifier in (learned, ak.relative_bias(table.clone().requires_grad_())):
            assert ak.explain_dispatch(q, k, v, modifier).backend == "torch"
            torch.testing.assert_close(ak.attention(q, k, v, modifier, backend="torch"),
                                       ak.attention(q, k, v, modifier, backend="reference"),
                                       rtol=1e-5, atol=1e-5)
    far = ak.alibi(torch.full((H,), 300.0))  # 300 · 299 > float16's largest, 65504
    reasons = dispatch.BACKENDS["torch"].not_supported_reasons(
        validate(*(t.half() for t in (q, k, v)), far))
    assert any("would round their bias to torch.float16" in r for r in reasons), reasons


@pytest.mark.parametrize("tq", [1, 3, 40])
def test_tiled_position_biases_with_few_and_many_query_rows(tq, gen):
    """The tiled engine's two ways with ALiBi and a relative bias on the fused kernel: few
    query rows per K/V head build their bias, many reverse K/V and read it as views; out and
    the q, k, v, slope and table gradients equal the reference's, GQA and Tq ≠ Tk."""
    q, k, v = make_qkv(gen, tq=tq, tk=70)
    for learned in (False, True):
        slopes = torch.rand(H, generator=gen).mul_(0.5).requires_grad_(learned)
        table = torch.randn(H, 32, generator=gen).requires_grad_(learned)
        mask = ak.alibi(slopes, "bottom_right") & ak.relative_bias(table)
        found = []
        for backend in ("tiled", "reference"):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = ak.attention(*leaves, mask, backend=backend)
            wrt = [*leaves, *([slopes, table] if learned else [])]
            found.append([out, *torch.autograd.grad((out * out).sum(), wrt)])
        for got, want in zip(*found):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_decoding_loop_with_position_biases_over_a_growing_cache(gen):
    """Token by token over a growing K/V (the call cache keys such steps without the key
    length): every step equals the reference with the bias at its own positions."""
    slopes, table = torch.rand(H, generator=gen) * 0.5, torch.randn(H, 32, generator=gen)
    for modifier in (ak.causal("bottom_right") & ak.alibi(slopes, "bottom_right"),
                     ak.relative_bias(table) & ak.sinks(torch.zeros(H))):
        k = v = torch.zeros(1, H, 0, D)
        for _ in range(20):
            k = torch.cat([k, torch.randn(1, H, 1, D, generator=gen)], 2)
            v = torch.cat([v, torch.randn(1, H, 1, D, generator=gen)], 2)
            q = torch.randn(1, H, 1, D, generator=gen)
            torch.testing.assert_close(ak.attention(q, k, v, modifier),
                                       ak.attention(q, k, v, modifier, backend="reference"),
                                       rtol=1e-5, atol=1e-6)


# ---- the call cache -------------------------------------------------------------------------------

def test_call_cache_sees_modifier_changes(gen, validations):
    count = validations
    q, k, v = make_qkv(gen, tq=6, tk=6)
    slopes = torch.tensor([0.1, 0.2, 0.3, 0.4])
    mask = ak.causal() & ak.alibi(slopes) & ak.softcap(2.0)

    def reference():
        return ak.attention(q, k, v, ak.causal() & ak.alibi(slopes.clone()) & ak.softcap(2.0),
                            backend="reference")
    first = ak.attention(q, k, v, mask)
    ak.attention(q, k, v, mask)
    assert len(count) == 1
    torch.testing.assert_close(first, reference())
    slopes.mul_(3)  # in place: a new version, validated again, the new slopes used
    torch.testing.assert_close(ak.attention(q, k, v, mask), reference())
    slopes.requires_grad_()  # now learnable: validated again, and its gradient comes
    out = ak.attention(q, k, v, mask)
    assert out.requires_grad and torch.autograd.grad(out.sum(), slopes)[0].abs().sum() > 0
    other = ak.causal() & ak.alibi(torch.ones(4)) & ak.softcap(2.0)
    ak.attention(q, k, v, other)
    before = len(count)
    ak.attention(q, k, v, ak.score_function(lambda s, b, h, i, j: s))
    ak.attention(q, k, v, ak.score_function(lambda s, b, h, i, j: s))
    assert len(count) == before + 2  # user code: never cached


# ---- memory ---------------------------------------------------------------------------------------

class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operation produced while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in (result if isinstance(result, (tuple, list)) else (result,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return result


@pytest.mark.parametrize("learned", [True, False])
def test_alibi_and_relative_on_tiled_build_no_tq_tk_tensor(learned):
    """At T = 4096 (16.8 M scores) the tiled engine's largest tensor, forward and backward,
    with ALiBi, a relative bias and causal masking, is a tile (a few M): learned slopes and
    table (the matmul backward, the vector's gradient by diagonal sums) and fixed ones (a
    relative bias alone: torch's fused backward with reversed keys; ALiBi: the matmul one);
    the reference at T = 512 does build T² (the meter sees it)."""
    gen = torch.Generator().manual_seed(0)
    t = 4096
    q, k, v = (torch.randn(1, 1, t, 8, generator=gen).requires_grad_() for _ in range(3))
    slopes = torch.tensor([0.1], requires_grad=learned)
    table = torch.randn(1, 32, generator=gen, requires_grad=learned)
    masks = [ak.causal() & ak.alibi(slopes) & ak.relative_bias(table)]
    if not learned:
        masks += [ak.causal() & ak.relative_bias(table), ak.causal() & ak.alibi(slopes)]
    for mask in masks:
        with LargestTensor() as meter:
            out = ak.attention(q, k, v, mask, backend="tiled")
            out.sum().backward()
        assert (slopes.grad is not None and table.grad is not None) == learned
        assert meter.largest <= t * t // 4, meter.largest
    small = [x.detach()[:, :, :512].requires_grad_() for x in (q, k, v)]
    with LargestTensor() as meter:
        ak.attention(*small, mask, backend="reference").sum().backward()
    assert meter.largest >= 512 * 512


# ---- explain --------------------------------------------------------------------------------------

def test_explain_shows_the_modified_scores(capsys):
    from attnkit import cli
    assert cli.main(["explain", "--softcap", "1.0", "--alibi", "0.5"]) == 0
    text = capsys.readouterr().out
    assert "3b. Modified" in text and "softcap" in text and "alibi" in text
    # (0, 0): tanh(1/√2) + 0.5·0; (2, 0): tanh(3/√2) + 0.5·(0 − 2)
    assert f"{math.tanh(2 ** -0.5):.4f}" == "0.6089" and "0.6089" in text
    assert f"{math.tanh(3 * 2 ** -0.5) - 1.0:.4f}" == "-0.0283" and "-0.0283" in text


def test_t5_buckets_with_an_odd_count_leave_the_last_unused():
    """As documented (and as transformers buckets): 33 buckets give ids 0..31 both ways."""
    ids = ak.t5_buckets(torch.arange(-500, 500), 33)
    assert int(ids.max()) == 31 and int(ids.min()) == 0


@pytest.mark.parametrize("backend", ["tiled", "auto"])
@pytest.mark.parametrize("invariant", [False, True])
def test_a_score_function_non_finite_only_where_masked_changes_nothing(backend, invariant, gen):
    """A log-distance penalty written for causal attention is −inf/NaN above the diagonal: the
    mask replaces those scores (docs/NUMERICS.md), so out, LSE and dq are reference's."""
    penalty = ak.score_function(
        lambda s, b, h, qi, kv: s - 0.5 * torch.log1p((qi - kv).to(s.dtype)))
    q, k, v = make_qkv(gen, tq=70, tk=70)
    for mask in (ak.causal() & penalty, ak.sliding_window(5) & penalty):
        runs = {}
        for name in (backend, "reference"):
            leaf = q.clone().requires_grad_()
            result = ak.attention(leaf, k, v, mask, backend=name, return_lse=True,
                                  invariant=invariant and name != "reference")
            (result.out.sum() + result.lse.sum()).backward()
            runs[name] = (result.out, result.lse, leaf.grad)
        for got, want in zip(runs[backend], runs["reference"]):
            torch.testing.assert_close(got, want.to(got.dtype), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", ["reference", "tiled", "torch", "auto"])
def test_a_bottom_right_relative_bias_decodes_the_rows_of_a_full_prefill(backend, gen):
    """``relative_bias(align="bottom_right")``: a decoding step or a chunk over the keys so far
    puts its queries on the last keys, so its rows are those of the whole prefill."""
    q, k, v = make_qkv(gen, tq=40, tk=40)
    table = torch.randn(H, 32, generator=gen)
    full = ak.attention(q, k, v, ak.causal() & ak.relative_bias(table), backend="reference")
    for tq in (1, 5):
        mask = ak.causal("bottom_right") & ak.relative_bias(table, align="bottom_right")
        torch.testing.assert_close(ak.attention(q[:, :, -tq:], k, v, mask, backend=backend),
                                   full[:, :, -tq:], rtol=2e-5, atol=2e-5)
    assert repr(ak.relative_bias(table, align="bottom_right")).endswith(
        "align='bottom_right')")
    with pytest.raises(ValueError, match="relative_bias.align='middle'"):
        ak.relative_bias(table, align="middle")
