"""attnkit.plan: a call validated and planned once, run on new tensors of its signature, gives
what attention() gives, bit for bit, with no host read; a mismatch or a stale mask raises."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import attnkit as ak
from attnkit.bench.hostreads import HostReads
from attnkit.masks import mask_tensors

B, HQ, HKV, T, D = 2, 4, 2, 24, 16


def _masks() -> dict:
    lens = torch.tensor([15, T])
    ids = torch.arange(T) // 7
    return {
        "none": None,
        "causal": ak.causal(),
        "bottom_right": ak.causal("bottom_right"),
        "window": ak.sliding_window(5),
        "padding": ak.padding(kv_lengths=lens),
        "left padding": ak.padding(kv_starts=T - lens),
        "kv_mask": ak.padding(kv_mask=torch.arange(T) < lens[:, None]),
        "q and kv": ak.padding(q_lengths=lens, kv_lengths=lens),
        "causal & padding": ak.causal() & ak.padding(kv_lengths=lens),
        "documents": ak.documents(ids),
        "documents(causal)": ak.documents(ids, causal="top_left"),
        "dense": ak.dense(torch.rand(T, T, generator=torch.Generator().manual_seed(1)) < 0.8),
        "softcap": ak.causal() & ak.softcap(5.0),
        "alibi": ak.causal() & ak.alibi(torch.rand(HQ)),
        "sinks": ak.padding(kv_lengths=lens) & ak.sinks(torch.zeros(HQ)),
    }


def _qkv(gen, dtype=torch.float32, grad=False):
    q = torch.randn(B, HQ, T, D, generator=gen, dtype=dtype)
    k, v = torch.randn(2, B, HKV, T, D, generator=gen, dtype=dtype).unbind(0)
    return [t.requires_grad_(grad) for t in (q, k, v)]


@pytest.mark.parametrize("backend", ["auto", "tiled", "reference"])
@pytest.mark.parametrize("name", list(_masks()))
def test_a_plan_gives_what_attention_gives(name, backend, gen):
    mask = _masks()[name]
    plan = ak.plan(*_qkv(gen), mask, backend=backend, return_lse=True)
    for _ in range(3):  # new tensors of the signature, every layer of a step
        q, k, v = _qkv(gen)
        got = plan(q, k, v)
        want = ak.attention(q, k, v, mask, backend=backend, return_lse=True)
        assert torch.equal(got.out.nan_to_num(7.0), want.out.nan_to_num(7.0)), name
        assert torch.equal(got.lse, want.lse), name


@pytest.mark.parametrize("name", ["causal", "padding", "left padding", "alibi"])
def test_gradients_through_a_plan_equal_attention_s(name, gen):
    mask = _masks()[name]
    plan = ak.plan(*_qkv(gen, torch.float64, grad=True), mask)
    leaves = _qkv(gen, torch.float64, grad=True)
    grads = []
    for run in (lambda q, k, v: plan(q, k, v), lambda q, k, v: ak.attention(q, k, v, mask)):
        copies = [t.detach().clone().requires_grad_() for t in leaves]
        out = run(*copies)
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape))
        grads.append([t.grad for t in copies])
    for got, want in zip(*grads):
        assert torch.equal(got, want)


def test_garbage_and_non_finite_values_follow_the_rules(gen):
    """Garbage past the real keys never reaches the result; a non-finite real key makes its
    rows NaN: the plan keeps attention()'s rules."""
    lens = torch.tensor([10, T])
    mask = ak.padding(kv_lengths=lens)
    plan = ak.plan(*_qkv(gen), mask)
    q, k, v = _qkv(gen)
    clean = plan(q, k, v)
    k[0, :, 10:], v[0, :, 10:] = float("nan"), float("inf")
    assert torch.equal(plan(q, k, v), clean)
    k[1, 0, 3, 0] = float("nan")
    out = plan(q, k, v)
    assert torch.isnan(out[1, :2]).all() and torch.equal(out[1, 2:], clean[1, 2:])


def test_running_a_plan_reads_no_value(gen):
    """Making a plan may read the mask's values (its checks); running it reads none."""
    masks = _masks()
    for name in ("padding", "left padding", "causal & padding", "documents", "window"):
        plan = ak.plan(*_qkv(gen), masks[name])
        q, k, v = _qkv(gen)
        plan(q, k, v)
        with HostReads() as reads:
            plan(q, k, v)
        assert reads.count == 0, (name, dict(reads.by_kind))


def test_other_tensors_raise_with_both_signatures(gen):
    plan = ak.plan(*_qkv(gen), ak.causal())
    q, k, v = _qkv(gen)
    for args in ((q[:, :, :8], k, v), (q.double(), k.double(), v.double()),
                 (q.transpose(2, 3).contiguous().transpose(2, 3), k, v),
                 (q.requires_grad_(), k, v)):
        with pytest.raises(ValueError, match=r"plan was made for q \(2, 4, 24, 16\).*got q"):
            plan(*args)
    assert plan.fits(*_qkv(gen)) and not plan.fits(q[:, :1], k, v)
    with torch.no_grad(), pytest.raises(ValueError, match="grad mode differs.*use_reentrant"):
        plan(*_qkv(gen))  # what a reentrant checkpoint's forward does


@pytest.mark.parametrize("inference", [False, True], ids=["tensors", "inference tensors"])
@pytest.mark.parametrize("kind", ["padding", "documents", "bias"])
def test_a_mask_written_in_place_after_planning_raises(gen, kind, inference):
    """Also for tensors made under ``torch.inference_mode``, which have no version counter
    (their values are compared)."""
    with torch.inference_mode(inference):
        values = {"padding": torch.tensor([10, T]), "documents": torch.arange(T) // 5,
                  "bias": torch.randn(1, 1, T, T, generator=gen)}[kind]
        mask = {"padding": lambda: ak.padding(kv_lengths=values),
                "documents": lambda: ak.documents(values) & ak.causal(),
                "bias": lambda: ak.bias(values)}[kind]()
        plan = ak.plan(*_qkv(gen), mask)
        assert not plan.stale()
        values[0] = values[0] + 2
        assert plan.stale()
        with pytest.raises(ValueError, match="written in place"):
            plan(*_qkv(gen))


@pytest.mark.parametrize("backend", ["auto", "torch", "tiled", "reference"])
@pytest.mark.parametrize("combine", ["alone", "& causal", "| window", "bucket function"])
def test_a_plan_over_a_function_reads_what_it_reads_in_every_run(gen, backend, combine):
    """A ``from_function`` mask (or a bucket function) reads tensors no version counter ties
    to the mask: each run evaluates it again, as attention() does, and sees a write to what
    it reads."""
    doc = torch.zeros(T, dtype=torch.long)
    fn = ak.from_function(lambda b, h, q_idx, kv_idx: doc[q_idx] == doc[kv_idx])
    buckets = ak.relative_bias(torch.randn(HQ, 2, generator=gen),
                               buckets=lambda rel: (doc[rel.clamp(0, T - 1)] > 0).long())
    mask = {"alone": fn, "& causal": ak.causal() & fn, "| window": fn | ak.sliding_window(3),
            "bucket function": buckets}[combine]
    q, k, v = _qkv(gen)
    if combine == "bucket function":  # a decoding step: torch's kernel takes the bias built
        q = q[:, :, -1:]
    plan = ak.plan(q, k, v, mask, backend=backend)
    plan(q, k, v)
    doc[T // 2:] = 1
    torch.testing.assert_close(plan(q, k, v), ak.attention(q, k, v, mask, backend="reference"))


def test_a_plan_reads_a_large_inference_tensor_afresh_in_every_run(gen):
    """An inference tensor over 4 MiB is not compared by value: the plan does not keep what
    it derives from it, so a write to it is seen."""
    t = 1100  # a float bias [1, 1, t, t]: 4.8 MB
    with torch.inference_mode():
        values = torch.randn(1, 1, t, t, generator=gen)
    q, k, v = (torch.randn(1, 2, t, 8, generator=gen) for _ in range(3))
    plan = ak.plan(q, k, v, ak.bias(values), backend="torch")
    plan(q, k, v)
    with torch.inference_mode():
        values[..., t // 2:] = float("-inf")
    torch.testing.assert_close(plan(q, k, v), ak.attention(q, k, v, ak.bias(values.clone()),
                                                           backend="reference"))


def test_dropout_and_generator_are_checked_on_every_call(gen):
    q, k, v = _qkv(gen)
    ak.attention(q, k, v, ak.causal())
    for bad in (None, False):
        with pytest.raises(ValueError, match="dropout_p"):
            ak.attention(q, k, v, ak.causal(), dropout_p=bad)
    with pytest.raises(TypeError, match="generator"):
        ak.attention(q, k, v, ak.causal(), generator="seed")


def test_a_plan_refuses_mask_tensors_whose_requires_grad_changed(gen):
    """Planned with frozen ALiBi slopes (torch's kernel takes them as constants), run after
    they require grad: refused, never run without their gradient."""
    q, k, v = _qkv(gen)
    slopes = torch.rand(HQ)
    plan = ak.plan(q[:, :, :1], k, v, ak.alibi(slopes, "bottom_right"))
    slopes.requires_grad_()
    assert plan.stale()
    with pytest.raises(ValueError, match="requires_grad changed"):
        plan(q[:, :, :1], k, v)


def test_a_write_torch_does_not_count_is_seen_after_increment_version(gen):
    """The remedy docs/DESIGN.md gives for a write through ``.data``."""
    q, k, v = _qkv(gen)
    slopes = torch.rand(HQ)
    before = ak.attention(q[:, :, :1], k, v, ak.alibi(slopes))
    slopes.data.mul_(3)
    torch.autograd.graph.increment_version(slopes)
    torch.testing.assert_close(ak.attention(q[:, :, :1], k, v, ak.alibi(slopes)),
                               ak.attention(q[:, :, :1], k, v, ak.alibi(slopes.clone())))
    assert not torch.equal(before, ak.attention(q[:, :, :1], k, v, ak.alibi(slopes)))


def test_plans_refuse_autocast(gen):
    q, k, v = _qkv(gen)
    plan = ak.plan(q, k, v, ak.causal())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match="autocast"):
            plan(q, k, v)
        with pytest.raises(ValueError, match="autocast"):
            ak.plan(q, k, v, ak.causal())


def test_a_plan_inside_a_compiled_function_runs_as_attention(gen):
    q, k, v = _qkv(gen)
    mask = ak.padding(kv_lengths=torch.tensor([10, T]))
    plan = ak.plan(q, k, v, mask)
    compiled = torch.compile(lambda q, k, v: plan(q, k, v), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), ak.attention(q, k, v, mask))


@pytest.mark.parametrize("inference", [False, True], ids=["", "inference_mode"])
@pytest.mark.parametrize("device", ["meta", "fake"])
def test_plans_propagate_shapes_on_meta_and_fake_tensors(device, inference):
    def run(q, k, v):
        mask = ak.padding(kv_lengths=torch.tensor([10, T], device=q.device))
        plan = ak.plan(q, k, v, mask)
        return plan(q, k, v)
    shapes = [(B, HQ, T, D), (B, HKV, T, D), (B, HKV, T, D)]
    with torch.inference_mode(inference):
        if device == "meta":
            out = run(*(torch.empty(s, device="meta") for s in shapes))
        else:
            with FakeTensorMode():
                out = run(*(torch.empty(s) for s in shapes))
    assert out.shape == (B, HQ, T, D)


def test_stale_says_whether_the_mask_was_written(gen):
    lens = torch.tensor([10, T])
    plan = ak.plan(*_qkv(gen), ak.padding(kv_lengths=lens))
    assert not plan.stale()
    lens.add_(0)
    assert plan.stale()


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_plan_watches_its_own_tensors(how):
    """A copy's tensors count their versions anew: an unwritten copy runs, a copy written in
    place is stale, and a copy of a stale plan stays stale."""
    import copy
    import pickle

    def copied(plan):
        return copy.deepcopy(plan) if how == "deepcopy" else pickle.loads(pickle.dumps(plan))
    q = torch.randn(2, 2, 16, 8)
    lengths = torch.full((2,), 16)
    lengths.sub_(0)
    lengths.sub_(0)  # version 2
    plan = ak.plan(q, q, q, ak.causal() & ak.padding(None, lengths), backend="torch")
    plan(q, q, q)
    twin = copied(plan)
    assert not twin.stale()
    torch.testing.assert_close(twin(q, q, q), plan(q, q, q))
    (own,) = [t for t in mask_tensors(twin.mask) if t is not None]
    own.fill_(5)  # one write: the copy's counter reaches the original's recorded one
    assert twin.stale() and not plan.stale()
    lengths.fill_(3)
    assert copied(plan).stale()
