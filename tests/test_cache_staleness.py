"""Caches never answer for a mask's old values: a mask reused after its tensors were written to
in place through torch (``t[...] = x``, ``t.copy_``, ``t.add_``) gives the attention of the new
values on every backend, as the float64 reference computes them.

The caches concerned key a mask by its tensors' identity and version counter
(:func:`attnkit.masks.tensor_key`; no value is read, so keying costs no device sync): the call
cache (validation and the backend's choice), the tiled plans, the triton layouts, the runs of
causal documents and the masks' own memos. A write torch does not count (through numpy shared
memory, through ``.data``) is not seen: the documented rule is to build a new mask after one.
``dense`` and ``bias`` are never cached; they are here to show that every mask kind with a
tensor reads its current values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_within_2x, import_triton_interpreted, interpreted_triton_launch

import_triton_interpreted()  # before attnkit: the triton cases run interpreted on CPU

import attnkit as ak  # noqa: E402
from attnkit import dispatch  # noqa: E402
from attnkit.inputs import validate  # noqa: E402

B, H, T, D = 2, 2, 160, 8  # T spans several tiles: tiled's keys come in blocks of 128
_rng = np.random.default_rng(0)
_POS = np.arange(T)

# kind → (build the mask from its tensor, the tensor's values before, after)
CASES = {
    "padding_kv_lengths": (lambda t: ak.padding(kv_lengths=t), np.array([50, T]), np.array([T, 20])),
    "padding_q_lengths": (lambda t: ak.padding(q_lengths=t), np.array([T, 50]), np.array([30, T])),
    "padding_kv_starts": (lambda t: ak.padding(kv_starts=t), np.array([0, 90]), np.array([140, 10])),
    "padding_kv_mask": (lambda t: ak.padding(kv_mask=t), _POS[None, :] < np.array([[50], [T]]),
                        _POS[None, :] >= np.array([[20], [140]])),
    "documents": (lambda t: ak.documents(t), _POS // 40, _POS // 100),
    "documents&causal": (lambda t: ak.documents(t) & ak.causal(), _POS // 40,
                         np.minimum(_POS // 20, 2)),
    "documents_causal": (lambda t: ak.documents(t, causal="top_left"), _POS // 40,
                         np.minimum(_POS // 20, 2)),
    "documents_causal_batched": (lambda t: ak.documents(t, causal="bottom_right"),
                                 np.stack([_POS // 40, _POS // 60]),
                                 np.stack([_POS // 30, _POS // 150])),
    "causal_sequences": (lambda t: ak.causal(sequences=ak.padding(kv_lengths=t)),
                         np.array([50, T]), np.array([T, 100])),
    "dense": (lambda t: ak.dense(t), _rng.random((B, 1, T, T)) > 0.3, _rng.random((B, 1, T, T)) > 0.6),
    "bias": (lambda t: ak.bias(t), _rng.standard_normal((1, H, T, T), dtype=np.float32),
             4 * _rng.standard_normal((1, H, T, T), dtype=np.float32)),
    "alibi": (lambda t: ak.causal() & ak.alibi(t), np.array([0.5, 0.25], dtype=np.float32),
              np.array([0.05, -0.1], dtype=np.float32)),
    "relative_bias": (lambda t: ak.relative_bias(t), _rng.standard_normal((H, 32), dtype=np.float32),
                      4 * _rng.standard_normal((H, 32), dtype=np.float32)),
    "sinks": (lambda t: ak.causal() & ak.sinks(t), np.array([0.0, 1.0], dtype=np.float32),
              np.array([3.0, -2.0], dtype=np.float32)),
}


def _write(how: str, t: torch.Tensor, new: np.ndarray) -> None:
    """Write ``new`` into ``t`` in place, the way ``how`` says (each bumps its version)."""
    if how == "copy":
        t.copy_(torch.from_numpy(new))
    else:  # item assignment
        t[...] = torch.from_numpy(new)


def _qkv(dtype=torch.float32):
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(B, H, T, D, generator=gen, dtype=torch.float64).to(dtype) for _ in range(3)]


def _backend(name: str, monkeypatch) -> None:
    if name == "triton":
        interpreted_triton_launch()
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _check(name: str, got: torch.Tensor, build, values: np.ndarray, q, k, v) -> None:
    """``got`` equals the float64 reference for ``build(values)`` (within 2× the error of the
    reference's own math in float32)."""
    mask32, mask64 = (build(torch.from_numpy(values.copy())) for _ in range(2))
    truth = ak.attention(*(t.double() for t in (q, k, v)), mask64, backend="reference")
    plain = ak.attention(q, k, v, mask32, backend="reference")
    assert_within_2x(name, got, truth, plain, torch.float32)


@pytest.mark.parametrize("backend", ["tiled", "torch", "auto", "reference", "triton"])
@pytest.mark.parametrize("how", ["copy", "setitem"])
@pytest.mark.parametrize("kind", sorted(CASES))
def test_a_reused_mask_reads_its_tensors_new_values(kind, how, backend, monkeypatch):
    _backend(backend, monkeypatch)
    build, before, after = CASES[kind]
    array = before.copy()
    t = torch.from_numpy(array)
    q, k, v = _qkv()
    mask = build(t)
    reasons = dispatch.BACKENDS[backend].not_supported_reasons(validate(q, k, v, mask)) \
        if backend != "auto" else []
    if reasons:
        pytest.skip(f"{backend} refuses {kind}: {'; '.join(reasons)}")
    _check(f"{kind} before", ak.attention(q, k, v, mask, backend=backend), build, before, q, k, v)
    _write(how, t, after)
    if kind == "padding_kv_mask":  # padding(kv_mask=...) reads the mask when built (documented)
        mask = build(t)
    _check(f"{kind} after a {how} write", ak.attention(q, k, v, mask, backend=backend), build,
           after, q, k, v)


@pytest.mark.parametrize("how", ["copy", "setitem"])
def test_lengths_out_of_range_after_a_write_are_reported(how):
    """The call cache validates again when a mask's values changed: a length that no longer
    fits raises as it would have on the first call."""
    array = np.array([5, T])
    t = torch.from_numpy(array)
    mask = ak.padding(kv_lengths=t)
    q, k, v = _qkv()
    ak.attention(q, k, v, mask)
    _write(how, t, np.array([5, T + 1]))
    with pytest.raises(ValueError, match="out of range"):
        ak.attention(q, k, v, mask)


@pytest.mark.parametrize("how", ["copy", "setitem"])
def test_documents_no_longer_contiguous_after_a_write_are_reported(how):
    """Causal documents whose ids were rewritten so that a document is split raise the same
    error as a mask built with those ids (the runs are derived again, not reused)."""
    array = _POS // 40
    t = torch.from_numpy(array)
    mask = ak.documents(t, causal="top_left")
    q, k, v = _qkv()
    ak.attention(q, k, v, mask, backend="tiled")
    split = array.copy()
    split[-1] = 0
    _write(how, t, split)
    with pytest.raises(ValueError, match="not one contiguous run"):
        ak.attention(q, k, v, mask, backend="tiled")


def test_cache_keys_follow_versions_and_identity():
    """A key changes with a write through torch and reads no value; two tensors of equal
    content have different keys (a cached value may hold its tensor); an inference tensor,
    which has no version counter, is keyed by its content."""
    from attnkit.bench.hostreads import HostReads
    t = torch.tensor([3, 4])
    mask = ak.padding(kv_lengths=t)
    keep: list = []
    with HostReads() as reads:
        key = ak.masks.cache_key(mask, keep)
    assert reads.count == 0 and any(held is t for held in keep)
    assert ak.masks.cache_key(mask, []) == key
    t[0] = 2
    assert ak.masks.cache_key(mask, []) != key
    assert ak.masks.cache_key(ak.padding(kv_lengths=torch.tensor([2, 4])), []) != \
        ak.masks.cache_key(mask, [])
    with torch.inference_mode():
        frozen = torch.tensor([3, 4])
    assert ak.masks.cache_key(ak.padding(kv_lengths=frozen), []) == \
        ak.masks.cache_key(ak.padding(kv_lengths=frozen), [])
    too_big = torch.zeros(ak.masks.KEY_BYTES // 8 + 1, dtype=torch.long)
    with torch.inference_mode():
        too_big = too_big.clone()
    assert ak.masks.cache_key(ak.documents(too_big), []) is None


def test_the_call_cache_keeps_a_bounded_amount_of_what_masks_derive(monkeypatch):
    """A server with a new padding mask each call: the cache keeps the dense biases those
    masks derived for its latest calls only, about its byte bound, not one per entry."""
    from attnkit import call
    from attnkit.inputs import CallCache, _nbytes

    cache = CallCache(derived_bytes=16 << 20)
    monkeypatch.setattr(call, "CALLS", cache)
    q = torch.randn(4, 2, 256, 32)
    for n in range(40):  # a bias [4, 1, 256, 256] float32 (1 MiB) and more per call
        ak.attention(q, q, q, ak.padding(kv_lengths=[256, 200, 100 + n, 50]), backend="torch")
    kept = sum(_nbytes(entry[0].derived) for entry in cache._calls.values())
    assert 4 << 20 < kept <= (16 + 4) << 20, kept  # the bound, and one entry not yet counted
    assert len(cache._calls) < 40


def test_the_call_cache_counts_the_memory_its_masks_hold(monkeypatch):
    """Each step's lengths a view of one large buffer: an entry keeps the whole buffer
    alive, so it counts against the byte bound, and few such entries stay."""
    from attnkit import call
    from attnkit.inputs import CallCache

    cache = CallCache(derived_bytes=16 << 20)
    monkeypatch.setattr(call, "CALLS", cache)
    q = torch.randn(2, 2, 8, 4)
    for n in range(20):
        buffer = torch.full((1 << 20,), 8, dtype=torch.long)  # 8 MiB
        buffer[1] = 1 + n % 7
        ak.attention(q, q, q, ak.padding(kv_lengths=buffer[:2]), backend="tiled")
    assert len(cache._calls) <= 3


def test_the_call_cache_evicts_the_least_recently_used_call(monkeypatch):
    from attnkit import call
    from attnkit.inputs import CallCache

    cache = CallCache(entries=4)
    monkeypatch.setattr(call, "CALLS", cache)
    q = torch.randn(1, 2, 8, 4)
    hot = ak.causal()
    ak.attention(q, q, q, hot)
    [entry] = cache._calls.values()
    for t in range(1, 9):  # a new shape each time, the hot call between
        ak.attention(q[:, :, :t], q, q, ak.causal("bottom_right"))
        ak.attention(q, q, q, hot)
    assert any(kept is entry for kept in cache._calls.values())  # never evicted, never redone


def test_the_call_cache_keeps_no_tensor_with_autograd_history():
    """ALiBi slopes computed each step (by a small network): the call's cache entry would
    keep them and their graph alive; such calls are not cached, and nothing holds them in a
    reference cycle (freed only when the garbage collector runs: disabled here)."""
    import gc
    import weakref

    net = torch.nn.Linear(4, 2)
    q = torch.randn(1, 2, 8, 4)
    gc.disable()
    try:
        slopes = net(torch.ones(4)).sigmoid()  # [2], with a graph
        ak.attention(q, q, q, ak.causal() & ak.alibi(slopes))
        gone = weakref.ref(slopes)
        del slopes
        assert gone() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_mask_derives_anew(how):
    """What a used mask derived is keyed by its tensors' identities: a copy (whose tensors
    are new, and whose ids a later object may reuse) carries none of it, and computes from
    its own values."""
    import copy
    import pickle

    ids = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0])
    mask = ak.documents(ids)
    q = torch.randn(1, 2, 8, 4)
    ak.attention(q, q, q, mask)
    assert mask.__dict__.get("_memo")
    copied = copy.deepcopy(mask) if how == "deepcopy" else pickle.loads(pickle.dumps(mask))
    assert "_memo" not in vars(copied)
    copied.q_ids[..., 4:] = 1  # (the copy's keys are its queries' ids)
    want = ak.attention(q, q, q, ak.documents(torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])))
    torch.testing.assert_close(ak.attention(q, q, q, copied), want)


def _fused_adamw_step(param: torch.Tensor) -> None:
    """One step of ``torch.optim.AdamW(fused=True)`` on ``param``, which moves its values
    and not its version counter."""
    optimizer = torch.optim.AdamW([param], lr=0.5, fused=True)
    before, version = param.detach().clone(), param._version
    param.grad = torch.ones_like(param)
    optimizer.step()
    assert not torch.equal(param.detach(), before) and param._version == version


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen-for-eval"])
@pytest.mark.parametrize("kind", ["alibi", "relative_bias", "bias"])
@pytest.mark.parametrize("call", ["attention", "plan"])
def test_a_learnable_tensor_written_by_a_fused_optimizer_is_read_anew(kind, call, frozen):
    """A parameter a fused optimizer steps keeps its version counter, so nothing derived from
    a parameter is kept, even one frozen (``requires_grad_(False)``) for the evaluation and
    stepped in between: a decoding-shaped evaluation (torch's kernel with the position bias
    made dense), a plan, reads the stepped values."""
    gen = torch.Generator().manual_seed(0)
    q1, k, v = (torch.randn(1, 2, t, 8, generator=gen) for t in (1, 12, 12))
    make = {"alibi": lambda p: ak.alibi(p, align="bottom_right"),
            "relative_bias": lambda p: ak.relative_bias(p, align="bottom_right"),
            "bias": ak.bias}[kind]
    param = torch.nn.Parameter({"alibi": torch.rand(2, generator=gen),
                                "relative_bias": torch.randn(2, 32, generator=gen),
                                "bias": torch.randn(1, 2, 1, 12, generator=gen)}[kind])
    mask = make(param)
    with torch.no_grad():
        param.requires_grad_(not frozen)
        plan = ak.plan(q1, k, v, mask) if call == "plan" else None
        run = ((lambda: plan(q1, k, v)) if plan is not None
               else (lambda: ak.attention(q1, k, v, mask)))
        first = run()
        param.requires_grad_(True)
        _fused_adamw_step(param)
        param.requires_grad_(not frozen)
        want = ak.attention(q1.double(), k.double(), v.double(), make(param.detach().double()),
                            backend="reference")
        got = run()
    assert not torch.allclose(first.double(), want, atol=1e-3)  # the step changed the result
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_a_plan_watches_the_callers_bias_not_its_float64_copy():
    """A float32 bias with float64 inputs is fitted into a float64 copy; the plan watches the
    caller's tensor, so a write to it makes the plan stale."""
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    bias = torch.randn(1, 2, 4, 4)
    plan = ak.plan(q, q, q, ak.bias(bias))
    assert not plan.stale()
    bias.add_(1.0)
    assert plan.stale()
    with pytest.raises(ValueError, match="written in place"):
        plan(q, q, q)


def test_what_an_optimizer_may_step_is_never_keyed():
    """Parameters, leaves that require grad and views of either are what an optimizer steps
    (a fused one without moving the version counter); a tensor a layer computes, with
    autograd history, is not, and what derives from it is still kept per forward pass."""
    from attnkit.masks import learnable

    param = torch.nn.Parameter(torch.randn(2, 4))
    leaf = torch.randn(2, 4, requires_grad=True)
    with torch.no_grad():
        views = [param[None], leaf.t()]
    computed = param * 2
    assert all(map(learnable, [param, leaf, *views]))
    assert not learnable(computed) and not learnable(computed[None])
    assert not learnable(torch.randn(2, 4))


def test_a_plan_watches_modifiers_beside_a_mask_function():
    """A mask function hides what it reads, not the score modifiers joined to it: a write to
    ALiBi slopes next to ``from_function`` makes the plan stale."""
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 8, 8)
    slopes = torch.rand(2)
    mask = ak.from_function(lambda b, h, i, j: j >= 0) & ak.alibi(slopes, align="bottom_right")
    plan = ak.plan(q, k, k, mask)
    plan(q, k, k)
    slopes.mul_(8)
    assert plan.stale()
    with pytest.raises(ValueError, match="written in place"):
        plan(q, k, k)


def test_a_plan_over_a_parameter_runs_on_its_planned_backend(monkeypatch):
    """A plan over a parameter runs each call as attention() does, on the backend it chose:
    one made under ``use_backend("reference")`` stays there outside it."""
    q = torch.randn(1, 2, 4, 8)
    mask = ak.bias(torch.nn.Parameter(torch.randn(1, 2, 4, 4)))
    with ak.use_backend("reference"):
        plan = ak.plan(q, q, q, mask)
    ran = []
    real = dispatch.run
    monkeypatch.setattr(dispatch, "run", lambda chosen, inputs: ran.append(chosen.NAME)
                        or real(chosen, inputs))
    plan(q, q, q)
    assert plan.backend.NAME == "reference" and ran == ["reference"]
