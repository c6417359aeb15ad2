"""Seeded fuzz of bad input at the public entry points.

Each test draws (hypothesis, derandomized) a valid call of an entry point, breaks one thing
in it, and checks that the call raises exactly the ``ValueError`` or ``TypeError`` of
validation, whose message names the offending shapes or values: never a ``RuntimeError``,
``IndexError``, ``KeyError`` or ``AssertionError`` from torch or from deep inside attnkit,
never a result. :func:`test_valid_edges_are_not_refused` checks the other side: calls at the
edges of what is valid (one query, one key, a head dim of 1, many batch dims, empty batches
and sequences) run, and agree with the reference backend.

A broken call is a :class:`Bad`: the call, the error type it must raise and the words its
message must hold (shapes as ``str(tuple(shape))``, values by ``repr``).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnkit as ak
from attnkit.nn import KVCache, MultiHeadAttention
from attnkit.paged import PagedKVCache

SETTINGS = dict(derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Bad(NamedTuple):
    call: Callable[[], object]
    error: type
    words: tuple


def check(bad: Bad) -> None:
    """``bad.call()`` raises exactly ``bad.error`` with every word of ``bad.words`` in its
    message."""
    try:
        bad.call()
    except (ValueError, TypeError, RuntimeError, IndexError, KeyError, AssertionError,
            AttributeError, ZeroDivisionError) as error:
        assert type(error) is bad.error, (f"expected {bad.error.__name__}, got "
                                          f"{type(error).__name__}: {error}")
        message = str(error)
        for word in bad.words:
            assert str(word) in message, f"{word!r} not in the message:\n{message}"
    else:
        raise AssertionError(f"no error; expected {bad.error.__name__} naming {bad.words}")


def shape(t) -> str:
    return str(tuple(t.shape))


class Call(NamedTuple):
    """A valid attention call: caller-layout q, k, v and their normalised sizes."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    batch: tuple  # the leading dims (none for [T, D], (B,) for [B, T, D])
    heads: int  # Hq (1 without a head dim)
    kv_heads: int
    gen: torch.Generator

    @property
    def flat_batch(self) -> int:
        return math.prod(self.batch)

    @property
    def scores(self) -> tuple:
        """The caller's score shape: ``[..., Hq, Tq, Tk]`` (no head dim for rank 2 and 3)."""
        heads = (self.heads,) if self.q.dim() >= 4 else ()
        return (*self.batch, *heads, self.q.shape[-2], self.k.shape[-2])


@st.composite
def calls(draw, min_len: int = 1) -> Call:
    rank = draw(st.integers(2, 8))  # up to 5 batch dims
    batch = tuple(draw(st.lists(st.integers(1, 2), min_size=max(rank - 3, 0) + (rank == 3),
                                max_size=max(rank - 3, 0) + (rank == 3))))
    kv_heads = draw(st.integers(1, 2)) if rank >= 4 else 1
    heads = kv_heads * (draw(st.integers(1, 3)) if rank >= 4 else 1)
    tq, tk = draw(st.integers(min_len, 5)), draw(st.integers(min_len, 6))
    dk, dv = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    lead, kv_lead = ((*batch, heads), (*batch, kv_heads)) if rank >= 4 else (batch, batch)

    def make(*size):
        return torch.randn(*size, generator=gen, dtype=dtype)
    return Call(make(*lead, tq, dk), make(*kv_lead, tk, dk), make(*kv_lead, tk, dv), batch,
                heads, kv_heads, gen)


def _other(draw, size: int) -> int:
    """A size other than ``size`` and 1 (so that it never broadcasts against it)."""
    return draw(st.sampled_from([n for n in (2, 3, 4, 7) if n != size]))


# ---- attention: the tensors ---------------------------------------------------------------

def _resized(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    shape_ = list(t.shape)
    shape_[dim] = size
    return torch.zeros(shape_, dtype=t.dtype)


TENSOR_KINDS = ["rank", "head_dim", "kv_len", "heads", "dtype_mix", "not_float", "meta",
                "empty_feature", "no_heads", "not_tensor", "kv_batch"]


def bad_tensors(draw, c: Call, kind: str, A: Callable = ak.attention) -> Bad:
    """A call of ``A`` (``attention``, or an entry point that validates as it does) with
    broken tensors (``kind``: which break; a kind the call's rank cannot take, a tensor that
    is not one)."""
    q, k, v = c.q, c.k, c.v
    if kind == "rank":
        k2, v2 = (k[None], v[None]) if draw(st.booleans()) or k.dim() == 2 else (k[0], v[0])
        return Bad(lambda: A(q, k2, v2), ValueError, ("number of dims", shape(q), shape(k2)))
    if kind == "head_dim":
        k2 = _resized(k, -1, _other(draw, k.shape[-1]))
        return Bad(lambda: A(q, k2, v), ValueError, ("feature dim", shape(q), shape(k2)))
    if kind == "kv_len":
        v2 = _resized(v, -2, _other(draw, v.shape[-2]))
        return Bad(lambda: A(q, k, v2), ValueError, ("length Tk", shape(k), shape(v2)))
    if kind == "heads" and q.dim() >= 4:
        kv_heads = draw(st.integers(2, 3))
        q2 = _resized(q, -3, kv_heads * draw(st.integers(1, 2)) + 1)
        k2, v2 = _resized(k, -3, kv_heads), _resized(v, -3, kv_heads)
        return Bad(lambda: A(q2, k2, v2), ValueError, ("multiple", shape(q2), shape(k2)))
    if kind == "kv_batch" and q.dim() >= 3:
        v2 = _resized(v, 0, v.shape[0] + 1)
        return Bad(lambda: A(q, k, v2), ValueError, (shape(k), shape(v2)))
    if kind == "dtype_mix":
        other = draw(st.sampled_from([torch.float16, torch.bfloat16]))
        which = draw(st.sampled_from(["k", "v"]))
        k2, v2 = (k.to(other), v) if which == "k" else (k, v.to(other))
        return Bad(lambda: A(q, k2, v2), TypeError, (str(q.dtype), str(other), "share one dtype"))
    if kind == "not_float":
        dtype = draw(st.sampled_from([torch.int32, torch.int64, torch.uint8, torch.bool,
                                      torch.complex64]))
        q2, k2, v2 = (t.to(dtype) for t in (q, k, v))
        return Bad(lambda: A(q2, k2, v2), TypeError, (str(dtype), "floating point"))
    if kind == "meta":
        which = draw(st.integers(0, 2))
        tensors = [q, k, v]
        tensors[which] = tensors[which].to("meta")
        return Bad(lambda: A(*tensors), ValueError, ("meta", "one device"))
    if kind == "empty_feature":
        if draw(st.booleans()):
            q2, k2, v2 = _resized(q, -1, 0), _resized(k, -1, 0), v
        else:
            q2, k2, v2 = q, k, _resized(v, -1, 0)
        return Bad(lambda: A(q2, k2, v2), ValueError, ("empty feature dim",))
    if kind == "no_heads" and q.dim() >= 4:
        q2 = _resized(q, -3, 0)
        return Bad(lambda: A(q2, k, v), ValueError, ("0 heads", shape(q2)))
    which = draw(st.sampled_from(["q", "k", "v"]))
    value = draw(st.sampled_from([None, [[1.0]], 1.0]))
    args = [q, k, v]
    args["qkv".index(which)] = value
    return Bad(lambda: A(*args), TypeError, (which, "torch.Tensor", type(value).__name__))


# ---- attention: the arguments -------------------------------------------------------------

ARGUMENT_KINDS = ["scale_value", "scale_type", "dropout", "backend", "flag", "generator_type",
                  "generator_device"]


def bad_arguments(draw, c: Call, kind: str) -> Bad:
    q, k, v = c.q, c.k, c.v
    A = ak.attention
    if kind == "scale_value":
        scale = draw(st.sampled_from([math.nan, math.inf, -math.inf, 1e300 * 1e300]))
        return Bad(lambda: A(q, k, v, scale=scale), ValueError, (f"scale={scale!r}",))
    if kind == "scale_type":
        scale = draw(st.sampled_from([torch.tensor(0.5), "0.5", True, 1j, [0.5]]))
        return Bad(lambda: A(q, k, v, scale=scale), TypeError, ("scale", repr(scale)))
    if kind == "dropout":
        p = draw(st.sampled_from([-0.1, 1.0, 1.5, math.nan, math.inf, True, "0.1"]))
        return Bad(lambda: A(q, k, v, dropout_p=p), ValueError, (f"dropout_p={p!r}", "[0, 1)"))
    if kind == "backend":
        name = draw(st.sampled_from(["flash", "Torch", "", None, 3, "sdpa"]))
        return Bad(lambda: A(q, k, v, backend=name), ValueError, (repr(name), "'auto'"))
    if kind == "flag":
        which = draw(st.sampled_from(["return_lse", "return_weights"]))
        value = draw(st.sampled_from([1, "yes", None]))
        return Bad(lambda: A(q, k, v, **{which: value}), TypeError, (f"{which}={value!r}",))
    if kind == "generator_type":
        return Bad(lambda: A(q, k, v, dropout_p=0.1, generator=0), TypeError,
                   ("torch.Generator", "int"))

    class OtherDevice(torch.Generator):  # a generator of an accelerator (none here)
        @property
        def device(self):
            return torch.device("cuda", 0)
    return Bad(lambda: A(q, k, v, dropout_p=0.1, generator=OtherDevice()), ValueError,
               ("cuda:0", "cpu", shape(q)))


# ---- attention: masks and modifiers built for other shapes ----------------------------------

MASK_KINDS = ["pad_long", "pad_negative", "pad_float", "pad_batch", "pad_2d", "pad_meta",
              "docs_len", "docs_float", "docs_batch", "broadcast", "broadcast_rank",
              "mask_dtype", "bias_dtype", "alibi", "relative", "sinks", "window", "align"]


def bad_masks(draw, c: Call, kind: str) -> Bad:
    q, k, v = c.q, c.k, c.v
    A = ak.attention
    batch, tq, tk = c.flat_batch, q.shape[-2], k.shape[-2]
    side = draw(st.sampled_from(["q", "kv"]))
    length = tq if side == "q" else tk
    if kind == "pad_long":
        lengths = [length] * batch
        lengths[draw(st.integers(0, batch - 1))] = length + draw(st.integers(1, 3))
        mask = ak.padding(**{f"{side}_lengths": torch.tensor(lengths)})
        return Bad(lambda: A(q, k, v, mask=mask), ValueError,
                   (f"{side}_lengths={lengths}", f"[0, {length}]"))
    if kind == "pad_negative":
        lengths = [0] * batch
        lengths[draw(st.integers(0, batch - 1))] = -draw(st.integers(1, 3))
        return Bad(lambda: ak.padding(**{f"{side}_lengths": torch.tensor(lengths)}),
                   ValueError, (f"{side}_lengths={lengths}", "0 or more"))
    if kind == "pad_float":
        dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bool]))
        lengths = torch.ones(batch, dtype=dtype)
        return Bad(lambda: ak.padding(**{f"{side}_lengths": lengths}), TypeError,
                   (str(dtype), "integer lengths"))
    if kind == "pad_batch":
        n = batch + draw(st.integers(1, 2))
        mask = ak.padding(**{f"{side}_lengths": torch.zeros(n, dtype=torch.long)})
        return Bad(lambda: A(q, k, v, mask=mask), ValueError,
                   (f"{n} entries", f"the batch has {batch}"))
    if kind == "pad_2d":
        lengths = torch.zeros(1, batch, dtype=torch.long)
        return Bad(lambda: ak.padding(**{f"{side}_lengths": lengths}), ValueError,
                   (shape(lengths), "[B]"))
    if kind == "pad_meta":
        mask = ak.padding(kv_lengths=torch.zeros(batch, dtype=torch.long, device="meta"))
        return Bad(lambda: A(q, k, v, mask=mask), ValueError, ("meta", f"({batch},)"))
    if kind == "docs_len":
        n = length + draw(st.sampled_from([-1, 1])) if length > 1 else length + 1
        ids = torch.zeros(n, dtype=torch.long)
        other = torch.zeros(tk if side == "q" else tq, dtype=torch.long)
        mask = ak.documents(ids, other) if side == "q" else ak.documents(other, ids)
        return Bad(lambda: A(q, k, v, mask=mask), ValueError,
                   (f"{side}_ids has shape ({n},)", f"{length} positions"))
    if kind == "docs_float":
        ids = torch.zeros(tq, dtype=draw(st.sampled_from([torch.float32, torch.float16])))
        return Bad(lambda: ak.documents(ids), TypeError, (str(ids.dtype), "integers"))
    if kind == "docs_batch":
        rows = batch + draw(st.integers(1, 2))
        mask = ak.documents(torch.zeros(rows, tq, dtype=torch.long),
                            torch.zeros(rows, tk, dtype=torch.long))
        return Bad(lambda: A(q, k, v, mask=mask), ValueError,
                   (f"{rows} rows", f"the batch has {batch}"))
    if kind in ("broadcast", "broadcast_rank"):
        scores = list(c.scores)
        if kind == "broadcast":
            dim = draw(st.integers(0, len(scores) - 1))
            scores[dim] = _other(draw, scores[dim])
        else:
            scores = [2] + scores
        dtype = draw(st.sampled_from([torch.bool, q.dtype]))
        mask = torch.ones(scores, dtype=dtype)
        if draw(st.booleans()):
            mask = ak.dense(mask) if dtype == torch.bool else ak.bias(mask)
        return Bad(lambda: A(q, k, v, mask=mask), ValueError,
                   (str(tuple(scores)), str(list(c.scores)), "broadcastable"))
    if kind == "mask_dtype":
        dtype = draw(st.sampled_from([torch.int64, torch.uint8, torch.complex64]))
        return Bad(lambda: A(q, k, v, mask=torch.ones(tq, tk, dtype=dtype)), TypeError,
                   (str(dtype),))
    if kind == "bias_dtype":
        dtype = torch.float16 if draw(st.booleans()) else torch.bfloat16
        return Bad(lambda: A(q, k, v, mask=torch.zeros(tq, tk, dtype=dtype)), TypeError,
                   (str(dtype), str(q.dtype), f"({tq}, {tk})"))
    heads = c.heads
    if kind == "alibi":
        slopes = torch.ones(_other(draw, heads))
        return Bad(lambda: A(q, k, v, mask=ak.alibi(slopes)), ValueError,
                   (f"slopes has shape {shape(slopes)}", f"H={heads}"))
    if kind == "relative":
        table = torch.ones(_other(draw, heads), 8)
        return Bad(lambda: A(q, k, v, mask=ak.relative_bias(table)), ValueError,
                   (f"table has shape {shape(table)}", f"H={heads}"))
    if kind == "sinks":
        logits = torch.zeros(_other(draw, heads))
        return Bad(lambda: A(q, k, v, mask=ak.sinks(logits)), ValueError,
                   (f"logits has shape {shape(logits)}", f"H={heads}"))
    if kind == "window":
        left = draw(st.sampled_from([-1, 1.5, True, "2"]))
        error = ValueError if left == -1 else TypeError
        return Bad(lambda: ak.sliding_window(left), error, (f"left={left!r}",))
    align = draw(st.sampled_from(["bottom", "top-left", 1, None]))
    return Bad(lambda: ak.causal(align), ValueError, (f"align={align!r}", "'top_left'"))


@pytest.mark.parametrize("kind", TENSOR_KINDS)
@settings(max_examples=15, **SETTINGS)
@given(data=st.data())
def test_attention_refuses_bad_tensors(kind, data):
    check(bad_tensors(data.draw, data.draw(calls()), kind))


@pytest.mark.parametrize("kind", ARGUMENT_KINDS)
@settings(max_examples=10, **SETTINGS)
@given(data=st.data())
def test_attention_refuses_bad_arguments(kind, data):
    check(bad_arguments(data.draw, data.draw(calls()), kind))


@pytest.mark.parametrize("kind", MASK_KINDS)
@settings(max_examples=12, **SETTINGS)
@given(data=st.data())
def test_attention_refuses_masks_and_modifiers_of_other_shapes(kind, data):
    check(bad_masks(data.draw, data.draw(calls()), kind))


@pytest.mark.parametrize("entry", [ak.plan, ak.explain_dispatch])
@settings(max_examples=30, **SETTINGS)
@given(data=st.data())
def test_plan_and_explain_refuse_what_attention_refuses(entry, data):
    """A plan is made through validation (the same errors) and run only on its own
    signature; ``explain_dispatch`` validates as ``attention`` does."""
    c = data.draw(calls())
    check(bad_tensors(data.draw, c, data.draw(st.sampled_from(TENSOR_KINDS)), entry))
    planned = ak.plan(c.q, c.k, c.v, ak.causal())
    q2 = _resized(c.q, -2, c.q.shape[-2] + 1).to(c.q.dtype)
    check(Bad(lambda: planned(q2, c.k, c.v), ValueError,
              ("this plan was made for", shape(c.q), shape(q2))))


# ---- constructors ---------------------------------------------------------------------------

CONSTRUCTORS = [
    (lambda: ak.padding(), ValueError, ("needs q_lengths or kv_lengths",)),
    (lambda: ak.padding(kv_lengths=[1], kv_mask=torch.ones(1, 2, dtype=torch.bool)), TypeError,
     ("not both",)),
    (lambda: ak.padding(kv_mask=torch.ones(2, 3)), TypeError, ("torch.float32",)),
    (lambda: ak.padding(kv_mask=torch.tensor([[True, False, True]])), ValueError,
     ("(1, 3)", "101")),
    (lambda: ak.documents(None), TypeError, ("NoneType",)),
    (lambda: ak.documents(torch.zeros(1, 2, 3, dtype=torch.long)), TypeError, ("(1, 2, 3)",)),
    (lambda: ak.dense(torch.ones(2, 2)), TypeError, ("torch.float32", "attnkit.bias()")),
    (lambda: ak.bias(torch.ones(2, 2, dtype=torch.long)), TypeError, ("torch.int64",)),
    (lambda: ak.from_function(3), TypeError, ("int",)),
    (lambda: ak.from_function(lambda b, h, i: i), TypeError, ("(b, h, i)",)),
    (lambda: ak.causal(sequences=ak.causal()), TypeError, ("causal()",)),
    (lambda: ak.sliding_window(1, -2), ValueError, ("right=-2",)),
    (lambda: ak.softcap(0.0), ValueError, ("cap=0.0",)),
    (lambda: ak.softcap(-1.0), ValueError, ("cap=-1.0",)),
    (lambda: ak.softcap(math.nan), ValueError, ("cap=nan",)),
    (lambda: ak.softcap(math.inf), ValueError, ("cap=inf",)),
    (lambda: ak.softcap("1"), TypeError, ("'1'",)),
    (lambda: ak.softcap(torch.tensor(1.0)), TypeError, ("tensor",)),
    (lambda: ak.alibi(torch.ones(4, dtype=torch.long)), TypeError, ("torch.int64",)),
    (lambda: ak.alibi([1.0, 2.0]), TypeError, ("list",)),
    (lambda: ak.alibi(torch.ones(4), "middle"), ValueError, ("'middle'",)),
    (lambda: ak.relative_bias(torch.ones(8)), ValueError, ("(8,)",)),
    (lambda: ak.relative_bias(torch.ones(2, 8, dtype=torch.long)), TypeError, ("torch.int64",)),
    (lambda: ak.relative_bias(torch.ones(2, 8), buckets=3), TypeError, ("int",)),
    (lambda: ak.sinks(torch.zeros(2, dtype=torch.long)), TypeError, ("torch.int64",)),
    (lambda: ak.t5_buckets(torch.arange(4), 2), ValueError, ("num_buckets=2",)),
    (lambda: ak.t5_buckets(torch.arange(4.0), 8), TypeError, ("torch.float32",)),
    (lambda: ak.score_function(lambda s, b, h, i, j: s, tensors=torch.ones(3)), TypeError,
     ("(3,)", "tensors=[t]")),
    (lambda: ak.score_function(lambda s, b, h, i, j: s, tensors=[1]), TypeError,
     ("sequence of tensors",)),
    (lambda: ak.causal() & 3, TypeError, ("int",)),
    (lambda: ~ak.softcap(2.0), TypeError, ("softcap(2.0)", "~")),
    (lambda: ak.softcap(2.0) | ak.causal(), TypeError, ("softcap(2.0)", "'|'")),
]


@pytest.mark.parametrize("index", range(len(CONSTRUCTORS)))
def test_mask_and_modifier_constructors_refuse_bad_arguments(index):
    call, error, words = CONSTRUCTORS[index]
    check(Bad(call, error, words))


# ---- nn.MultiHeadAttention ------------------------------------------------------------------

MHA_KINDS = ["embed", "kv_heads", "zero_heads", "dropout", "backend", "rank", "width", "dtype",
             "key_valid_shape", "key_valid_dtype", "lengths_shape", "lengths_dtype",
             "lengths_range", "lengths_no_cache", "flag", "cache_type"]


@pytest.mark.parametrize("kind", MHA_KINDS)
@settings(max_examples=6, **SETTINGS)
@given(data=st.data())
def test_multi_head_attention_refuses_bad_input(kind, data):
    draw = data.draw
    heads = draw(st.integers(1, 4))
    kv_heads = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    head_dim = draw(st.integers(1, 4))
    embed = heads * head_dim
    batch, length = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    module = MultiHeadAttention(embed, heads, kv_heads)
    x = torch.randn(batch, length, embed, generator=gen)
    if kind == "embed":
        bad_heads = draw(st.sampled_from([n for n in (3, 5, 7) if embed % n]))
        bad = Bad(lambda: MultiHeadAttention(embed, bad_heads), ValueError,
                  (f"embed_dim={embed}", f"num_heads={bad_heads}"))
    elif kind == "kv_heads":
        bad_kv = heads + 1
        bad = Bad(lambda: MultiHeadAttention(embed, heads, bad_kv), ValueError,
                  (f"num_kv_heads={bad_kv}",))
    elif kind == "zero_heads":
        bad = Bad(lambda: MultiHeadAttention(embed, 0), ValueError, ("num_heads=0",))
    elif kind == "dropout":
        p = draw(st.sampled_from([1.0, -0.5, math.nan]))
        bad = Bad(lambda: MultiHeadAttention(embed, heads, dropout=p), ValueError,
                  (f"dropout={p!r}",))
    elif kind == "backend":
        bad = Bad(lambda: MultiHeadAttention(embed, heads, backend="flash"), ValueError,
                  ("'flash'", "'auto'"))
    elif kind == "rank":
        y = x[None] if draw(st.booleans()) else x[0, 0]
        bad = Bad(lambda: module(y), ValueError, (shape(y), f"[B, T, {embed}]"))
    elif kind == "width":
        y = torch.zeros(batch, length, embed + 1)
        bad = Bad(lambda: module(y), ValueError, (f"width {embed + 1}", str(embed)))
    elif kind == "dtype":
        y = x.to(draw(st.sampled_from([torch.float64, torch.int64])))
        bad = Bad(lambda: module(y), TypeError, (str(y.dtype), "torch.float32"))
    elif kind == "key_valid_shape":
        valid = torch.ones(batch, length + 1, dtype=torch.bool)
        bad = Bad(lambda: module(x, key_valid=valid), ValueError,
                  (shape(valid), f"[{batch}, {length}]"))
    elif kind == "key_valid_dtype":
        valid = torch.ones(batch, length, dtype=draw(st.sampled_from([torch.float32,
                                                                      torch.int64])))
        bad = Bad(lambda: module(x, key_valid=valid), TypeError, (str(valid.dtype), "bool"))
    elif kind == "lengths_shape":
        lengths = torch.ones(batch + 1, dtype=torch.long)
        bad = Bad(lambda: module(x, cache=module.empty_cache(), lengths=lengths), ValueError,
                  (f"[{batch}]", f"({batch + 1},)"))
    elif kind == "lengths_dtype":
        lengths = torch.ones(batch)
        bad = Bad(lambda: module(x, cache=module.empty_cache(), lengths=lengths), TypeError,
                  ("torch.float32", f"[{batch}]"))
    elif kind == "lengths_range":
        lengths = [length + 1] * batch
        bad = Bad(lambda: module(x, cache=module.empty_cache(), lengths=torch.tensor(lengths)),
                  ValueError, (f"[0, {length}]", str(lengths)))
    elif kind == "lengths_no_cache":
        bad = Bad(lambda: module(x, lengths=torch.ones(batch, dtype=torch.long)), TypeError,
                  ("needs a cache",))
    elif kind == "flag":
        which = draw(st.sampled_from(["is_causal", "need_weights"]))
        value = draw(st.sampled_from(["yes", 1, None]))
        bad = Bad(lambda: module(x, **{which: value}), TypeError, (f"{which}={value!r}",))
    else:
        bad = Bad(lambda: module(x, cache={}), TypeError, ("dict",))
    check(bad)


# ---- caches -----------------------------------------------------------------------------------

CACHE_KINDS = ["heads", "dim", "dtype", "batch", "kv_mismatch", "rank", "lengths_range",
               "lengths_dtype", "not_tensor"]


@pytest.mark.parametrize("kind", CACHE_KINDS)
@settings(max_examples=8, **SETTINGS)
@given(data=st.data())
def test_kv_caches_refuse_misuse(kind, data):
    draw = data.draw
    batch, kv_heads = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    length, dim = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    keys = torch.randn(batch, kv_heads, length, dim, generator=gen)
    values = torch.randn(batch, kv_heads, length, dim, generator=gen)
    paged = draw(st.booleans())
    if paged:
        cache = PagedKVCache(batch * 2, max(length, 1))
        cache.append(keys, values)
    else:
        cache = KVCache.empty().append(keys, values)
    append = (cache.append if paged else lambda *a, **kw: cache.append(*a, **kw))
    step = torch.zeros(batch, kv_heads, 1, dim)
    if kind == "heads":
        new = torch.zeros(batch, kv_heads + 1, 1, dim)
        bad = Bad(lambda: append(new, new), ValueError, (shape(new),))
    elif kind == "dim":
        new = torch.zeros(batch, kv_heads, 1, dim + 1)
        bad = Bad(lambda: append(new, new), ValueError, (shape(new),))
    elif kind == "dtype":
        new = step.double()
        bad = Bad(lambda: append(new, new), ValueError if paged else TypeError,
                  ("torch.float64",))
    elif kind == "batch":
        new = torch.zeros(batch + 1, kv_heads, 1, dim)
        bad = Bad(lambda: append(new, new), ValueError,
                  (f"{batch + 1} sequences",) if paged else (shape(new),))
    elif kind == "kv_mismatch":
        new_values = torch.zeros(batch, kv_heads, 2, dim)
        bad = Bad(lambda: append(step, new_values), ValueError, (shape(new_values),))
    elif kind == "rank":
        new = torch.zeros(batch, 1, dim)
        bad = Bad(lambda: append(new, new), ValueError, (shape(new), "[B, Hkv, t, D]"))
    elif kind == "lengths_range":
        lengths = [2] * batch
        bad = Bad(lambda: append(step, step, lengths=torch.tensor(lengths)), ValueError,
                  (str(lengths),))
    elif kind == "lengths_dtype":
        bad = Bad(lambda: append(step, step, lengths=torch.ones(batch)), TypeError,
                  ("torch.float32",))
    else:
        bad = Bad(lambda: append([1.0], [1.0]), TypeError, ("torch.Tensor",))
    check(bad)


CACHE_CONSTRUCTORS = [
    (lambda: KVCache([1.0], [1.0], 1), TypeError, ("list",)),
    (lambda: KVCache(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4).double(), 2), TypeError,
     ("torch.float32", "torch.float64")),
    (lambda: KVCache(torch.zeros(1, 1, 2, 4, dtype=torch.long),
                     torch.zeros(1, 1, 2, 4, dtype=torch.long), 2), TypeError,
     ("torch.int64", "floating-point")),
    (lambda: KVCache(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4, device="meta"), 2),
     ValueError, ("cpu", "meta")),
    (lambda: KVCache(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), 2.0), TypeError,
     ("length=2.0",)),
    (lambda: KVCache(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), 3), ValueError,
     ("length=3", "2 positions")),
    (lambda: KVCache(torch.zeros(2, 1, 2, 4), torch.zeros(2, 1, 2, 4), 2, torch.tensor([1, 3])),
     ValueError, ("[1, 3]", "[0, 2]")),
    (lambda: KVCache.empty(capacity=0), ValueError, ("capacity=0",)),
    (lambda: KVCache.empty(window=2.5), TypeError, ("2.5",)),
    (lambda: PagedKVCache(0, 2), ValueError, ("num_blocks", "0")),
    (lambda: PagedKVCache.from_tables(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4).double(),
                                      [[0]], [1]), TypeError,
     ("PagedKVCache.from_tables", "torch.float64")),
    (lambda: PagedKVCache.from_tables(torch.zeros(2, 2, 1, 4),
                                      torch.zeros(2, 2, 1, 4, device="meta"), [[0]], [1]),
     TypeError, ("meta", "value_pool")),
    (lambda: PagedKVCache.from_tables(torch.zeros(2, 2, 1, 4, dtype=torch.long),
                                      torch.zeros(2, 2, 1, 4, dtype=torch.long), [[0]], [1]),
     TypeError, ("PagedKVCache.from_tables", "torch.int64")),
    (lambda: PagedKVCache.from_tables(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4),
                                      [[5]], [1]), ValueError, ("block 5", "2 blocks")),
    (lambda: ak.paged_attention(torch.zeros(1, 1, 1, 4), torch.zeros(2, 2, 1, 4),
                                torch.zeros(2, 2, 1, 4, device="meta"), [[0]], [1]),
     TypeError, ("value_pool torch.float32 meta",)),
]


@pytest.mark.parametrize("index", range(len(CACHE_CONSTRUCTORS)))
def test_cache_constructors_refuse_bad_arguments(index):
    call, error, words = CACHE_CONSTRUCTORS[index]
    check(Bad(call, error, words))


def test_paged_cache_sizes_take_numpy_integers():
    import numpy as np
    cache = PagedKVCache(np.int64(4), np.int32(2))
    assert (cache.num_blocks, cache.block_size) == (4, 2)
    assert type(cache.num_blocks) is int


def test_paged_cache_overflow_and_lengths_are_refused_and_leave_it_unchanged():
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(2, 2)
    cache.append(torch.randn(1, 1, 3, 4, generator=gen), torch.randn(1, 1, 3, 4, generator=gen))
    before = (cache.lengths, cache.free_blocks)
    step = torch.zeros(1, 1, 2, 4)
    check(Bad(lambda: cache.append(step, step), ValueError, ("full", "pool of 2")))
    check(Bad(lambda: cache.append(step, step, lengths=torch.tensor([3])), ValueError,
              ("[3]", "[0, 2]")))
    assert (cache.lengths, cache.free_blocks) == before


# ---- packed sequences -------------------------------------------------------------------------

VARLEN_KINDS = ["start", "fall", "dtype", "total", "rank", "empty", "k_count", "seqused",
                "max_seqlen", "heads", "meta"]


@pytest.mark.parametrize("kind", VARLEN_KINDS)
@settings(max_examples=6, **SETTINGS)
@given(data=st.data())
def test_varlen_refuses_bad_boundaries(kind, data):
    draw = data.draw
    lengths = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    total = sum(lengths)
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(total, 2, 4, generator=gen)
    k = torch.randn(total, 1, 4, generator=gen)
    V = ak.varlen_attention
    if kind == "start":
        bad_cu = [1, *cu[1:]]
        bad = Bad(lambda: V(q, k, k, bad_cu), ValueError, ("start at 0", str(bad_cu[:8])))
    elif kind == "fall" and len(cu) > 2:
        bad_cu = list(cu)
        bad_cu[1], bad_cu[2] = bad_cu[2], bad_cu[1]
        bad = Bad(lambda: V(q, k, k, bad_cu), ValueError, ("never fall", "sequence 1"))
    elif kind == "dtype":
        bad_cu = torch.tensor(cu, dtype=draw(st.sampled_from([torch.float32, torch.bool])))
        bad = Bad(lambda: V(q, k, k, bad_cu), TypeError, (str(bad_cu.dtype),))
    elif kind == "total" or kind == "fall":
        bad_cu = [*cu[:-1], cu[-1] + 1]
        bad = Bad(lambda: V(q, k, k, bad_cu), ValueError, (f"tokens {total}", str(total + 1)))
    elif kind == "rank":
        bad_cu = torch.tensor([cu])
        bad = Bad(lambda: V(q, k, k, bad_cu), ValueError, (shape(bad_cu), "[n + 1]"))
    elif kind == "empty":
        bad = Bad(lambda: V(q, k, k, []), ValueError, ("(0,)",))
    elif kind == "k_count":
        k2 = torch.zeros(total + 1, 1, 4)
        bad = Bad(lambda: V(q, k2, k2, cu), ValueError, (f"total_k {total + 1}",))
    elif kind == "seqused":
        used = [n + 1 for n in lengths]
        bad = Bad(lambda: V(q, k, k, cu, seqused_k=used), ValueError,
                  (f"seqused_k[0] = {used[0]}",))
    elif kind == "max_seqlen":
        bad = Bad(lambda: V(q, k, k, cu, max_seqlen_q=max(lengths) - 1), ValueError,
                  (f"max_seqlen_q={max(lengths) - 1}",))
    elif kind == "heads":
        k2 = torch.zeros(total, 3, 4)
        bad = Bad(lambda: V(q, k2, k2, cu), ValueError, (shape(q), shape(k2)))
    else:
        bad_cu = torch.tensor(cu, device="meta")
        bad = Bad(lambda: V(q, k, k, bad_cu), ValueError, ("meta",))
    check(bad)


# ---- valid edges --------------------------------------------------------------------------------

@settings(max_examples=80, **SETTINGS)
@given(st.data())
def test_valid_edges_are_not_refused(data):
    """One query, one key, a head dim of 1, many batch dims, an empty batch or sequence: the
    call runs, has the caller's shape, and agrees with the reference backend."""
    draw = data.draw
    c = draw(calls(min_len=0))
    q, k, v = c.q, c.k, c.v
    if draw(st.booleans()):  # an edge of each size
        edge = draw(st.sampled_from(["tq", "tk", "dk", "dv", "empty_batch"]))
        q, k, v = (_resized(q, -2, 1) if edge == "tq" else q,
                   _resized(k, -2, 1) if edge == "tk" else k,
                   _resized(v, -2, 1) if edge == "tk" else v)
        if edge in ("dk", "dv"):
            q, k, v = (q[..., :1], k[..., :1], v) if edge == "dk" else (q, k, v[..., :1])
        if edge == "empty_batch" and q.dim() >= 3:
            q, k, v = q[:0], k[:0], v[:0]
    batch = math.prod(q.shape[:-3] if q.dim() >= 4 else q.shape[:-2])
    tq, tk = q.shape[-2], k.shape[-2]
    mask = draw(st.sampled_from([
        None, ak.causal(), ak.causal("bottom_right"), ak.sliding_window(1),
        ak.padding(kv_lengths=torch.full((batch,), tk)),
        ak.padding(q_lengths=torch.zeros(batch, dtype=torch.long)),
        ak.documents(torch.zeros(tq, dtype=torch.long), torch.zeros(tk, dtype=torch.long)),
        torch.ones(tq, tk, dtype=torch.bool), torch.zeros(1, tk, dtype=q.dtype),
    ]))
    out = ak.attention(q, k, v, mask)
    assert out.shape == (*q.shape[:-1], v.shape[-1])
    expected = ak.attention(q, k, v, mask, backend="reference")
    tol = 1e-5 if q.dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def _keys_values(t: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(1, 2, t, 8, generator=gen), torch.randn(1, 2, t, 8, generator=gen)


def test_a_cache_of_the_caller_s_tensors_takes_any_integer_length():
    """``KVCache(keys, values, length)``: a numpy integer, and ``keys.shape[2]`` traced
    symbolically (``make_fx``, ``torch.export`` with a dynamic dim) are lengths; a float is
    refused naming the keys' shape, whatever their rank."""
    import numpy as np
    from torch.fx.experimental.proxy_tensor import make_fx

    k, v = _keys_values()
    assert KVCache(k, v, np.int64(3)).length == 3
    traced = make_fx(lambda k, v: KVCache(k, v, k.shape[2]).keys + 1, tracing_mode="symbolic")(k, v)

    class Build(torch.nn.Module):
        def forward(self, k, v):
            return KVCache(k, v, k.shape[2]).keys + 1

    t = torch.export.Dim("t", min=2, max=64)
    program = torch.export.export(Build(), (k, v), dynamic_shapes=({2: t}, {2: t}), strict=False)
    k5, v5 = _keys_values(5)
    assert torch.equal(traced(k5, v5), k5 + 1)
    assert torch.equal(program.module()(k5, v5), k5 + 1)
    with pytest.raises(TypeError, match=r"length=3.0.*keys \(3, 4\)"):
        KVCache(torch.zeros(3, 4), torch.zeros(3, 4), 3.0)


def test_a_generator_is_checked_only_where_dropout_draws():
    """A generator of another device is refused where dropout draws from it, not where it
    is unused (``dropout_p=0``) nor where shapes alone propagate (meta)."""
    class OtherDevice(torch.Generator):  # a generator of an accelerator (none here)
        @property
        def device(self):
            return torch.device("cuda", 0)
    k, v = _keys_values()
    q = k.flip(2)
    assert ak.attention(q, k, v, generator=OtherDevice()).shape == q.shape
    meta = q.to("meta")
    assert ak.attention(meta, meta, meta, dropout_p=0.5, generator=OtherDevice()).is_meta
    with pytest.raises(ValueError, match="cuda:0"):
        ak.attention(q, k, v, dropout_p=0.5, generator=OtherDevice())
