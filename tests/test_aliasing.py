"""Results own their memory; inputs, masks and caches are never written.

What a caller may do with a result: write it in place (``out += residual``,
``out.mul_(gate)``), keep it across calls, reuse the input buffers for the next step. So no
result shares storage with q, k, v, a mask's tensors or a cache's keys; no two calls return
the same storage (a memoised buffer handed out twice); no call writes into the caller's
tensors; and a backward after an in-place write to the output either raises autograd's
"modified by an inplace operation" error, as torch's SDPA does, or gives the gradients of
the written result (never silently wrong ones).

Checked by storage overlap (``untyped_storage().data_ptr()`` ranges) and by writing into
every result, then comparing the inputs and a second call's result with clones. Every
backend that runs on CPU (triton through its interpreter), the edge shapes (Tk = 1, Tq = 1,
an empty batch, fully masked rows, D = 1), LSE and weights, sinks, a GQA decoding step (the
torch backend's stacked heads), varlen, paged attention and both caches, plans, the
compiled operator and inference mode.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from conftest import import_triton_interpreted, interpreted_triton_launch

import_triton_interpreted()

import attnkit as ak  # noqa: E402
from attnkit.masks import as_mask, held_tensors  # noqa: E402
from attnkit.nn import KVCache, MultiHeadAttention, PagedKVCache  # noqa: E402

CPU_BACKENDS = ("reference", "tiled", "torch", "auto")


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` overlap in memory (their storages' byte ranges)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    (start_a, size_a), (start_b, size_b) = ((s.data_ptr(), s.nbytes()) for s in (
        a.untyped_storage(), b.untyped_storage()))
    return start_a < start_b + size_b and start_b < start_a + size_a


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN."""
    return a.shape == b.shape and torch.equal(a.double().nan_to_num(12345.0),
                                              b.double().nan_to_num(12345.0))


def _tensors(result) -> dict:
    """A call's result tensors by name (an ``AttentionResult``'s fields, or a dict's)."""
    if isinstance(result, torch.Tensor):
        return {"out": result}
    if isinstance(result, dict):
        return result
    return {name: t for name, t in zip(result._fields, result) if isinstance(t, torch.Tensor)}


def _mask_tensors(mask) -> dict:
    if isinstance(mask, torch.Tensor):
        return {"mask": mask}
    return {} if mask is None else {f"mask[{i}]": t
                                    for i, t in enumerate(held_tensors(as_mask(mask)))}


def assert_owned(call, inputs: dict) -> None:
    """``call()``'s results share no storage with ``inputs`` (the caller's tensors), with each
    other or with a second call's; the call and writes into its results leave ``inputs`` and
    the second call's results as they were."""
    before = {name: t.detach().clone() for name, t in inputs.items()}
    first = _tensors(call())
    for (name, t), (held, x) in itertools.product(first.items(), inputs.items()):
        assert not _shares(t, x), f"{name} shares storage with the caller's {held}"
    for (a, x), (b, y) in itertools.combinations(first.items(), 2):
        assert not _shares(x, y), f"{a} and {b} share storage"
    second = _tensors(call())
    for (a, x), (b, y) in itertools.product(first.items(), second.items()):
        assert not _shares(x, y), f"a call's {a} shares storage with the next call's {b}"
    kept = {name: t.detach().clone() for name, t in second.items()}
    with torch.no_grad():
        for t in first.values():
            if t.is_floating_point():
                t.add_(1.0)  # the caller writes the result in place
    for name, t in inputs.items():
        assert _same(t.detach(), before[name]), f"the caller's {name} was written"
    for name, t in second.items():
        assert _same(t.detach(), kept[name]), f"the next call's {name} changed"


def _cases(gen: torch.Generator) -> dict:
    """``name → (q, k, v, mask)``: edge shapes and every kind of tensor a call holds."""
    def r(*shape):
        return torch.randn(*shape, generator=gen)
    return {
        "plain": (r(2, 2, 5, 4), r(2, 2, 7, 4), r(2, 2, 7, 4), None),
        "Tk=1": (r(2, 2, 5, 4), r(2, 2, 1, 4), r(2, 2, 1, 4), None),
        "Tq=1": (r(2, 2, 1, 4), r(2, 2, 7, 4), r(2, 2, 7, 4), None),
        "B=0": (r(0, 2, 5, 4), r(0, 2, 7, 4), r(0, 2, 7, 4), None),
        "D=1": (r(2, 2, 5, 1), r(2, 2, 7, 1), r(2, 2, 7, 1), None),
        "[T, D]": (r(5, 4), r(7, 4), r(7, 4), None),
        "fully masked": (r(2, 2, 5, 4), r(2, 2, 7, 4), r(2, 2, 7, 4),
                         torch.zeros(5, 7, dtype=torch.bool)),
        "bias": (r(2, 2, 5, 4), r(2, 2, 7, 4), r(2, 2, 7, 4), r(2, 1, 5, 7)),
        "padding": (r(2, 2, 5, 4), r(2, 2, 7, 4), r(2, 2, 7, 4),
                    ak.padding(None, torch.tensor([0, 7]))),
        "sinks": (r(2, 2, 5, 4), r(2, 2, 7, 4), r(2, 2, 7, 4), ak.sinks(r(2)) & ak.causal()),
        "alibi": (r(2, 2, 1, 4), r(2, 2, 7, 4), r(2, 2, 7, 4), ak.alibi(torch.tensor([0.5, 0.25]))),
        "GQA decode": (r(2, 4, 1, 4), r(2, 2, 7, 4), r(2, 2, 7, 4), None),
        "GQA decode, bias": (r(2, 4, 1, 4), r(2, 2, 7, 4), r(2, 2, 7, 4), r(2, 4, 1, 7)),
        "NaN query": (torch.full((1, 1, 3, 4), float("nan")), r(1, 1, 3, 4), r(1, 1, 3, 4),
                      None),
    }


CASES = tuple(_cases(torch.Generator()))
OUTPUTS = ((False, False), (True, False), (False, True), (True, True))


def _attention_owned(q, k, v, mask, backend: str, **options) -> int:
    """:func:`assert_owned` over ``attention`` with every output combination ``backend``
    runs; how many ran."""
    ran = 0
    inputs = {"q": q, "k": k, "v": v, **_mask_tensors(mask)}
    for lse, weights in OUTPUTS:
        def call():
            return ak.attention(q, k, v, mask, backend=backend, return_lse=lse,
                                return_weights=weights, **options)
        try:
            call()
        except ValueError as refused:  # not this backend's combination
            assert "cannot run" in str(refused)
            continue
        assert_owned(call, inputs)
        ran += 1
    return ran


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_attention_results_own_their_memory(backend, case):
    q, k, v, mask = _cases(torch.Generator().manual_seed(0))[case]
    assert _attention_owned(q, k, v, mask, backend)


@pytest.mark.parametrize("backend", ("tiled", "auto"))
def test_results_own_their_memory_under_inference_mode_and_invariance(backend):
    cases = _cases(torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for case in ("plain", "Tk=1", "fully masked", "sinks", "GQA decode"):
            q, k, v, mask = cases[case]
            assert _attention_owned(q, k, v, mask, backend), case
    for case in ("plain", "padding", "GQA decode"):
        q, k, v, mask = cases[case]
        assert _attention_owned(q, k, v, mask, backend, invariant=True), case


def test_triton_results_own_their_memory(monkeypatch):
    interpreted_triton_launch()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cases = _cases(torch.Generator().manual_seed(2))
    for case in ("plain", "Tk=1", "fully masked", "sinks", "GQA decode"):
        q, k, v, mask = cases[case]
        assert _attention_owned(q, k, v, mask, "triton"), case


def _gradients(q, k, v, mask, backend, target: str, write):
    """Gradients of q, k, v through ``attention`` with ``write`` applied to its ``target``
    result (in place when it writes in place), or ``None`` where autograd refuses the
    in-place write."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    result = ak.attention(*leaves, mask, backend=backend, return_lse=target == "lse")
    parts = _tensors(result)
    parts[target] = write(parts[target])
    gen = torch.Generator().manual_seed(3)
    loss = sum((t.nan_to_num(0.0, 0.0, 0.0) * torch.randn(t.shape, generator=gen)).sum()
               for _, t in sorted(parts.items()))
    try:
        return torch.autograd.grad(loss, leaves)
    except RuntimeError as error:
        assert "modified by an inplace operation" in str(error)
        return None


@pytest.mark.parametrize("target", ("out", "lse"))
@pytest.mark.parametrize("case", ("plain", "Tk=1", "fully masked", "padding", "sinks",
                                  "GQA decode"))
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_backward_after_an_inplace_write(backend, case, target):
    """Either autograd's in-place error or the gradients of the written result."""
    q, k, v, mask = _cases(torch.Generator().manual_seed(4))[case]
    gate = torch.randn((*q.shape[:-1], v.shape[-1]) if target == "out" else q.shape[:-1],
                       generator=torch.Generator().manual_seed(5))
    try:
        written = _gradients(q, k, v, mask, backend, target, lambda t: t.mul_(gate).add_(1.0))
    except ValueError as refused:
        assert "cannot run" in str(refused)
        return
    if written is None:
        return
    expected = _gradients(q, k, v, mask, backend, target, lambda t: t * gate + 1.0)
    for got, want in zip(written, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_varlen_and_paged_results_own_their_memory():
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(7, h, 4, generator=gen) for h in (4, 2, 2))
    cu = torch.tensor([0, 1, 7], dtype=torch.int32)
    for backend, lse, mask in itertools.product(CPU_BACKENDS, (False, True),
                                                (None, ak.causal())):
        assert_owned(lambda: ak.varlen_attention(q, k, v, cu, mask=mask, backend=backend,
                                                 return_lse=lse),
                     {"q": q, "k": k, "v": v, "cu": cu})
    key_pool, value_pool = (torch.randn(32, 16, 2, 8, generator=gen) for _ in range(2))
    table = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7, 8]])
    lengths = torch.tensor([0, 120])  # (a step read in place by runs of blocks, on auto)
    for backend, lse, q_len in itertools.product(CPU_BACKENDS, (False, True), (1, 3)):
        q = torch.randn(2, 4, q_len, 8, generator=gen)
        assert_owned(lambda: ak.paged_attention(q, key_pool, value_pool, table, lengths,
                                                mask=ak.causal("bottom_right"),
                                                backend=backend, return_lse=lse),
                     {"q": q, "key_pool": key_pool, "value_pool": value_pool,
                      "table": table, "lengths": lengths})


def test_cache_results_own_their_memory():
    gen = torch.Generator().manual_seed(7)

    def r(*shape):
        return torch.randn(*shape, generator=gen)
    # a paged decoding step over a prompt shared by forks (one kernel call for all of them)
    paged = PagedKVCache(64, 16)
    paged.append(r(1, 2, 300, 8), r(1, 2, 300, 8))
    paged.fork(0)
    paged.fork(0)
    paged.append(r(3, 2, 1, 8), r(3, 2, 1, 8))
    q = r(3, 4, 1, 8)
    for lse in (False, True):
        assert_owned(lambda: paged.attend(q, return_lse=lse),
                     {"q": q, "key_pool": paged.key_pool, "value_pool": paged.value_pool,
                      "keys": paged.keys, "values": paged.values})
    # KVCache.decode (torch's kernel over the store, read in place), ragged and not
    for lengths in (None, torch.tensor([300, 200])):
        cache = KVCache.empty().append(r(2, 2, 300, 8), r(2, 2, 300, 8), lengths=lengths)
        cache = cache.append(r(2, 2, 1, 8), r(2, 2, 1, 8))
        q = r(2, 4, 1, 8)
        for invariant in (False, True):
            assert cache.decode(q, invariant=invariant) is not None
            assert_owned(lambda: cache.decode(q, invariant=invariant),
                         {"q": q, "keys": cache.keys, "values": cache.values,
                          "store": cache._store.keys})


def test_cache_appends_never_write_the_callers_tensors():
    gen = torch.Generator().manual_seed(8)
    keys, values = torch.randn(2, 2, 6, 8, generator=gen), torch.randn(2, 2, 6, 8, generator=gen)
    lengths = torch.tensor([6, 2])
    step_keys, step_values = (torch.randn(2, 2, 1, 8, generator=gen) for _ in range(2))
    held = {"keys": keys, "values": values, "lengths": lengths, "step keys": step_keys,
            "step values": step_values}
    before = {name: t.clone() for name, t in held.items()}
    grown = KVCache(keys=keys, values=values, length=6, lengths=lengths).append(step_keys,
                                                                                step_values)
    for name, t in held.items():
        assert _same(t, before[name]), f"the caller's {name} was written"
        for kept in (grown.keys, grown.values, grown.lengths):
            assert not _shares(kept, t), f"the new cache holds the caller's {name}"
    # an older cache's keys stay as they were, whether its chain grows in place or branches
    first = KVCache.empty().append(keys, values, lengths=lengths)
    seen = first.keys.clone(), first.values.clone()
    chained = first.append(step_keys, step_values)
    branch = first.append(step_values, step_keys)
    with torch.no_grad():
        branch.keys.add_(1.0)  # (writing into a cache's views is the caller's own doing)
    assert _same(first.keys[0], seen[0][0]) and _same(first.keys[1, :, :2], seen[0][1, :, :2])
    assert _same(first.values[0], seen[1][0])
    assert not _shares(chained.keys[..., -1:, :], branch.keys[..., -1:, :])


@pytest.mark.parametrize("kind", ("kv", "paged"))
def test_module_outputs_and_caches_own_their_memory(kind):
    """The output and weights of a decoding step; its cache holds none of the caller's
    tensors, and the cache it extended keeps its keys (the new cache's own keys may be views
    of the same buffers: a cache is immutable to its users, :class:`KVCache`)."""
    gen = torch.Generator().manual_seed(9)
    module = MultiHeadAttention(16, 4, num_kv_heads=2).eval()
    prompt, step = torch.randn(2, 5, 16, generator=gen), torch.randn(2, 1, 16, generator=gen)
    with torch.no_grad():
        cache = module(prompt, cache=module.empty_cache() if kind == "kv"
                       else PagedKVCache(32, 4), is_causal=True).cache
    grown = []

    def call():
        with torch.no_grad():  # (a paged cache is written in place: each call extends a copy)
            given = copy.deepcopy(cache) if kind == "paged" else cache
            out, weights, extended = module(step, cache=given, is_causal=True, need_weights=True)
        grown.append(extended)
        return {"out": out, "weights": weights}
    inputs = {"step": step, "prompt": prompt}
    if kind == "kv":
        inputs.update(keys=cache.keys, values=cache.values)
    else:
        inputs.update(key_pool=cache.key_pool, value_pool=cache.value_pool)
    assert_owned(call, inputs)
    for extended in grown:
        for held in (extended.keys, extended.values):
            assert not (_shares(held, step) or _shares(held, prompt))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_plan_runs_own_their_memory(backend):
    gen = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(2, 2, n, 4, generator=gen) for n in (5, 7, 7))
    for mask in (None, torch.randn(5, 7, generator=gen), ak.padding(None, torch.tensor([3, 7])),
                 ak.sinks(torch.randn(2, generator=gen))):
        try:
            plan = ak.plan(q, k, v, mask, backend=backend, return_lse=backend != "torch")
        except ValueError as refused:
            assert "cannot run" in str(refused)
            continue
        assert_owned(lambda: plan(q, k, v), {"q": q, "k": k, "v": v, **_mask_tensors(mask)})


def test_compiled_results_own_their_memory():
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 2, n, 4, generator=gen) for n in (5, 7, 7))
    lengths = torch.tensor([3, 7])

    @torch.compile(backend="aot_eager", fullgraph=True)
    def call(q, k, v):
        return ak.attention(q, k, v, ak.padding(None, lengths), backend="tiled", return_lse=True)
    assert_owned(lambda: call(q, k, v), {"q": q, "k": k, "v": v, "lengths": lengths})
