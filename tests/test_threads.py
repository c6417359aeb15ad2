"""attention() called from several Python threads at once, as an inference server's thread pool
calls one model: the call cache, the masks' memos and the triton launcher's templates are
shared by the threads, and every call returns the bits it returns single-threaded.

Each test forces interleavings with ``sys.setswitchinterval`` and runs a bounded loop over
fixed inputs (no timing asserts)."""

from __future__ import annotations

import sys
import threading
import traceback
import types

import pytest
import torch

import attnkit as ak
from attnkit import call
from attnkit.backends.triton import launch
from attnkit.inputs import CallCache, _nbytes
from attnkit.masks import mask_fields, mask_tensors, memo


@pytest.fixture
def switching():
    """Threads switch as often as the interpreter allows while the test runs."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def _run_threads(count: int, work) -> list[str]:
    """``work(index)`` on ``count`` threads at once; the tracebacks of what they raised."""
    errors: list[str] = []

    def guarded(index):
        try:
            work(index)
        except Exception:  # noqa: BLE001  (reported by the test)
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def _server_calls() -> list:
    """A mix of calls as a server's threads make them: masks shared by every thread (a
    model's layers share one), new masks per call, shapes enough to evict a small call cache,
    explicit backends, modes set on the calling thread only, an LSE, a backward and a
    ``MultiHeadAttention`` decoding loop with its own ``KVCache``."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    shared_padding = ak.padding(kv_lengths=torch.tensor([5, 9, 16]))
    shared_documents = ak.documents(torch.tensor([0] * 7 + [1] * 5 + [2] * 12), causal="top_left")
    shared_window = ak.sliding_window(3, 0)
    calls = []
    for length in (16, 24):
        q, k, v = rnd(3, 2, length, 8), rnd(3, 2, length, 8), rnd(3, 2, length, 8)
        mask = shared_padding if length == 16 else ak.causal()
        calls += [
            lambda q=q, k=k, v=v, mask=mask: ak.attention(q, k, v, mask),
            lambda q=q, k=k, v=v: ak.attention(q, k, v, ak.padding(kv_lengths=torch.tensor(
                [3, 7, 11]))),
            lambda q=q, k=k, v=v: ak.attention(q, k, v, shared_window & ak.softcap(5.0)),
            lambda q=q, k=k, v=v: ak.attention(q, k, v, shared_window, backend="tiled"),
        ]
    k, v = rnd(3, 2, 16, 8), rnd(3, 2, 16, 8)
    for length in range(1, 9):  # one mask over queries of every length: its memos grow
        q = rnd(3, 2, length, 8)
        calls += [lambda q=q, k=k, v=v: ak.attention(q, k, v, shared_padding),
                  lambda q=q, k=k, v=v: ak.attention(q, k, v, shared_padding, backend="tiled")]
    q, k, v = rnd(1, 2, 24, 8), rnd(1, 2, 24, 8), rnd(1, 2, 24, 8)
    with torch.no_grad():
        plan = ak.plan(q, k, v, shared_documents)

    def under_backend():
        with ak.use_backend("reference"):
            return ak.attention(q, k, v, shared_documents)

    def invariant():
        with ak.invariant():
            return ak.attention(q, k, v, shared_documents)

    q_grad = rnd(1, 2, 24, 8).requires_grad_()

    def gradient():
        with torch.enable_grad():
            out = ak.attention(q_grad, k, v, shared_documents, backend="tiled")
            return torch.autograd.grad(out.sum(), q_grad)[0]

    calls += [
        lambda: ak.attention(q, k, v, shared_documents),
        lambda: ak.attention(q, k, v, shared_documents, backend="tiled"),
        lambda: ak.attention(q, k, v, shared_documents, return_lse=True).lse,
        lambda: plan(q, k, v),
        under_backend, invariant, gradient,
    ]
    mha = ak.nn.MultiHeadAttention(16, 2)
    with torch.no_grad():  # weights from the test's generator
        for parameter in mha.parameters():
            parameter.copy_(rnd(*parameter.shape) * 0.3)
    x = rnd(2, 8, 16)

    def decode():
        out, _, cache = mha(x[:, :4], cache=mha.empty_cache(), is_causal=True)
        outs = [out]
        for i in range(4, 8):
            out, _, cache = mha(x[:, i:i + 1], cache=cache, is_causal=True)
            outs.append(out)
        return torch.cat(outs, 1)

    return calls + [decode]


def test_call_cache_shared_by_threads(monkeypatch, switching):
    """Threads share the call cache (a small one, evicting all the time) and the masks: no
    call raises (an entry evicted between another thread's lookup and its move to the end,
    a call's derived values measured while another thread adds to them), each returns the
    bits it returns single-threaded, and the cache's byte count stays the sum of its
    entries' (a key two threads inserted at once counted twice would keep the cache
    evicting everything)."""
    cache = CallCache(entries=3)
    monkeypatch.setattr(call, "CALLS", cache)
    calls = _server_calls()
    with torch.no_grad():
        expected = [fn() for fn in calls]
    mismatches = []

    def work(index):
        order = torch.randperm(len(calls), generator=torch.Generator().manual_seed(index))
        with torch.no_grad():
            for _ in range(8):
                for i in order.tolist():
                    if not torch.equal(calls[i](), expected[i]):
                        mismatches.append(i)

    errors = _run_threads(6, work)
    assert not errors, errors[0]
    assert not mismatches
    assert set(cache._sizes) <= set(cache._calls)
    assert cache._bytes == sum(cache._sizes.values())


def test_mask_fields_while_another_thread_memos(switching):
    """A mask's fields (and its pickled state) are read while another thread's first use of
    the same mask adds its memos to the mask's ``__dict__``: no 'dictionary changed size
    during iteration'."""
    masks = [ak.padding(kv_lengths=torch.tensor([4, 3]), q_lengths=torch.tensor([2, 2]))
             for _ in range(1000)]
    current = [masks[0]]
    done = threading.Event()

    def reader(_):
        while not done.is_set():
            mask = current[0]
            assert "_memo" not in mask_fields(mask)
            assert "_memo" not in mask.__getstate__()

    def first_use(_):
        try:
            for mask in masks:
                current[0] = mask
                mask_tensors(mask)  # the mask's first memo
        finally:
            done.set()

    errors = _run_threads(2, lambda i: (reader, first_use)[i](i))
    assert not errors, errors[0]


def test_derived_bytes_measured_while_another_thread_derives(switching):
    """The call cache measures what an entry's mask derived (its memos) while another thread
    derives more from the same mask: no 'dictionary changed size during iteration'."""
    mask = ak.padding(kv_lengths=torch.tensor([4, 3]))
    tensors = mask_tensors(mask)
    done = threading.Event()

    def measure(_):
        while not done.is_set():
            _nbytes(mask.__dict__["_memo"])

    def derive(_):
        try:
            for i in range(5000):  # (MEMO_ENTRIES at most: the memos grow and are dropped)
                memo(mask, ("test", i), tensors, lambda: torch.zeros(2))
        finally:
            done.set()

    errors = _run_threads(2, lambda i: (measure, derive)[i](i))
    assert not errors, errors[0]


def _fake_kernels(monkeypatch):
    """The launcher's kernels module replaced by one kernel ``attn_fwd(x, tag)`` that runs
    nothing (the launcher's bookkeeping alone is under test)."""
    def attn_fwd(x, tag):
        pass
    kernel = types.SimpleNamespace(fn=attn_fwd)
    monkeypatch.setattr(launch, "kernels", lambda: types.SimpleNamespace(attn_fwd=kernel))


def test_triton_templates_shared_by_threads(monkeypatch, switching):
    """Threads add launch templates to one layout past its bound at once: none raises (two
    threads evicting the same oldest template) and the layout keeps at most
    ``CALLS_PER_LAYOUT``."""
    _fake_kernels(monkeypatch)
    layout = types.SimpleNamespace(calls={})
    plan = types.SimpleNamespace(scale=1.0, interpret=True, tiles=None, options=None,
                                 layout=layout)

    def work(index):
        for i in range(1000):
            x = torch.empty(index + 1, i % 40 + 1)
            call = launch._template(plan, "attn_fwd", dict(x=x), lambda: dict(tag=0), None,
                                    (16, 16))
            assert call.args["x"] is x

    errors = _run_threads(6, work)
    assert not errors, errors[0]
    assert len(layout.calls) <= launch.CALLS_PER_LAYOUT


def test_triton_tuning_keeps_each_templates_config(monkeypatch):
    """Two templates of one kernel tune at once (compiled launches' first calls): triton's
    autotuner keeps a run's best config on itself, so each template must read it before
    another run replaces it."""
    _fake_kernels(monkeypatch)
    first_tuning, second_tuned = threading.Event(), threading.Event()

    class Tuner:  # triton.autotune's state as its run leaves it
        best_config = None

        def __getitem__(self, grid):
            def run(x, tag):
                self.best_config = tag
                if tag == "first":
                    first_tuning.set()
                    second_tuned.wait(timeout=1.0)  # the other template tunes meanwhile, if it can
                else:
                    second_tuned.set()
            return run

    tuner = Tuner()
    monkeypatch.setattr(launch, "_tuned", lambda name, cache: tuner)
    options = types.SimpleNamespace(candidate=None, autotune_cache=False)
    plan = types.SimpleNamespace(interpret=False, options=options, invariant=False)
    calls = {tag: launch.Call("attn_fwd", dict(x=torch.zeros(1), tag=tag), None, (16, 16))
             for tag in ("first", "second")}

    def work(index):
        if index:
            assert first_tuning.wait(timeout=30)
        calls[("first", "second")[index]].run(plan)

    errors = _run_threads(2, work)
    assert not errors, errors[0]
    assert {tag: c.shared["config"] for tag, c in calls.items()} == {"first": "first",
                                                                     "second": "second"}


def test_triton_kernels_loaded_once_by_threads_calling_first(monkeypatch, switching):
    """Threads making a mode's first triton call at once share one kernels module: a module
    apiece would compile every kernel once per thread."""
    pytest.importorskip("triton")
    monkeypatch.setattr(launch, "_FLAVOURS", {})
    barrier = threading.Barrier(4)
    loaded = []

    def work(index):
        barrier.wait()
        loaded.append(launch.kernels())

    errors = _run_threads(4, work)
    assert not errors, errors[0]
    assert len(loaded) == 4 and all(module is loaded[0] for module in loaded)
