"""attnkit under the caller's process-wide and thread-local torch state: a default dtype or
device, deterministic algorithms, anomaly detection, grad modes, ``sdpa_kernel`` contexts,
thread counts, denormal flushing and print options change neither a result (forward and
backward, against the same call under torch's defaults and the float64 reference) nor the
state itself; attnkit's own modes come back after an exception. Every setting is restored in
a ``finally`` (other tests share the process)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from conftest import import_triton_interpreted, interpreted_triton_launch

import_triton_interpreted()

import attnkit as ak  # noqa: E402
from attnkit import call, dispatch, invariance  # noqa: E402
from attnkit.inputs import CallCache  # noqa: E402
from attnkit.nn import KVCache, MultiHeadAttention  # noqa: E402

CPU = torch.device("cpu")


# ---- the settings, each restored on exit --------------------------------------------------------

@contextlib.contextmanager
def default_dtype(dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def default_device(device):
    before = torch.get_default_device()
    torch.set_default_device(device)
    try:
        yield
    finally:
        # (None where it was cpu: setting "cpu" would leave a DeviceContext mode active, which
        # every later torch call, and dynamo's tracing, then goes through)
        torch.set_default_device(None if before == torch.device("cpu") else before)


@contextlib.contextmanager
def deterministic(warn_only: bool):
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def flush_denormal():
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


@contextlib.contextmanager
def print_options():
    torch.set_printoptions(precision=2, sci_mode=True, threshold=3)
    try:
        yield
    finally:
        torch.set_printoptions(profile="default")


@contextlib.contextmanager
def all_at_once():
    """Every setting that must not change a bit of the result, together."""
    with default_dtype(torch.float64), default_device("meta"), deterministic(False), \
            torch.autograd.set_detect_anomaly(True), flush_denormal(), print_options():
        yield


SETTINGS = {
    "default_float64": lambda: default_dtype(torch.float64),
    "default_float16": lambda: default_dtype(torch.float16),
    "default_bfloat16": lambda: default_dtype(torch.bfloat16),
    "default_meta": lambda: default_device("meta"),
    "deterministic": lambda: deterministic(False),
    "deterministic_warn_only": lambda: deterministic(True),
    "detect_anomaly": lambda: torch.autograd.set_detect_anomaly(True),
    "flush_denormal": flush_denormal,
    "print_options": print_options,
    "all_at_once": all_at_once,
}
"""Settings under which a call gives the same bits as under torch's defaults."""


def torch_state() -> dict:
    """The caller's state that attnkit must leave as it found it."""
    return dict(dtype=torch.get_default_dtype(), device=torch.get_default_device(),
                deterministic=torch.are_deterministic_algorithms_enabled(),
                warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
                grad=torch.is_grad_enabled(), inference=torch.is_inference_mode_enabled(),
                anomaly=torch.is_anomaly_enabled(), threads=torch.get_num_threads(),
                kernels=[torch._C._get_flash_sdp_enabled(), torch._C._get_math_sdp_enabled(),
                         torch._C._get_mem_efficient_sdp_enabled()],
                forced=getattr(dispatch._FORCED, "name", None),
                invariant=getattr(invariance._MODE, "on", False))


@pytest.fixture
def fresh_calls(monkeypatch):
    """Gives each call an empty call cache, so that a call validates (and derives what its
    mask needs) under the setting it runs in, not from an entry made under the defaults."""
    def fresh():
        monkeypatch.setattr(call, "CALLS", CallCache())
    fresh()
    return fresh


# ---- the calls ---------------------------------------------------------------------------------

TQ, TK = 9, 11


def _inputs(dtype=torch.float32, tq=TQ, tk=TK):
    """q ``[2, 4, tq, 8]``, k and v ``[2, 2, tk, 8]`` (GQA), on the CPU whatever the default
    device, from float64 draws whatever the default dtype."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, h, t, 8, generator=gen, dtype=torch.float64, device=CPU).to(dtype)
            for h, t in ((4, tq), (2, tk), (2, tk))]


def _mask(kind: str):
    """A fresh mask of each kind, its tensors made explicitly (float32 on the CPU)."""
    f32 = dict(dtype=torch.float32, device=CPU)
    lengths = torch.tensor([TK, 6], device=CPU)
    if kind == "none":
        return None
    if kind == "causal":
        return ak.causal()
    if kind == "padding_empty_rows":
        return ak.padding(kv_lengths=torch.tensor([TK, 0], device=CPU))
    if kind == "documents":
        return ak.documents(torch.tensor([[0] * 4 + [1] * 5, [0] * 2 + [1] * 7], device=CPU),
                            torch.tensor([[0] * 5 + [1] * 6, [0] * 3 + [1] * 8], device=CPU))
    if kind == "window":
        return ak.sliding_window(3)
    if kind == "bias":
        return torch.randn(2, 1, TQ, TK, generator=torch.Generator().manual_seed(5), **f32)
    if kind == "softcap":
        return ak.causal() & ak.softcap(5.0)
    if kind == "alibi":
        return ak.causal() & ak.alibi(torch.tensor([0.5, 0.25, 0.125, 0.0625], **f32))
    if kind == "sinks":
        return ak.padding(kv_lengths=lengths) & ak.sinks(torch.tensor([0.3, -0.2, 1.0, 0.0], **f32))
    raise KeyError(kind)


MASKS = ("none", "causal", "padding_empty_rows", "documents", "window", "bias", "softcap",
         "alibi", "sinks")


def _runs(backend: str, kind: str) -> bool:
    """Whether ``backend`` takes the mask kind (torch takes no softcap and no sinks)."""
    return not (backend == "torch" and kind in ("softcap", "sinks"))


def _call(backend: str, kind: str, dtype=torch.float32, settings=contextlib.nullcontext,
          want_lse: bool = True, **kwargs) -> dict:
    """One forward and backward under ``settings``: out, the LSE (when ``want_lse``; never on
    torch, which gives none with gradients) and dq, dk, dv, detached."""
    q, k, v = (t.requires_grad_() for t in _inputs(dtype))
    want_lse = want_lse and backend != "torch"
    mask = _mask(kind)
    with settings():
        result = ak.attention(q, k, v, mask, backend=backend, return_lse=want_lse, **kwargs)
        out, lse = (result.out, result.lse) if want_lse else (result, None)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9),
                           dtype=torch.float64, device=CPU).to(out.dtype)
        loss = (out.double() * dout.double()).sum()
        if lse is not None:  # (the LSE of a row without keys is −inf: no gradient there)
            loss = loss + torch.where(torch.isfinite(lse), lse, 0).double().sum()
        loss.backward()
    found = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if lse is not None:
        found["lse"] = lse
    return {name: t.detach() for name, t in found.items()}


def _truth(kind: str, backend: str) -> dict:
    """The call of ``backend`` on the float64 reference, under torch's defaults."""
    return _call("reference", kind, torch.float64, want_lse=backend != "torch")


def _assert_same(got: dict, want: dict, exact: bool = True) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].device == t.device, name
        if exact:
            assert torch.equal(got[name], t), f"{name} differs"
        else:
            torch.testing.assert_close(got[name], t, msg=name)


def _assert_near_truth(got: dict, truth: dict) -> None:
    for name, t in got.items():
        torch.testing.assert_close(t.double(), truth[name], rtol=1e-5, atol=1e-5, msg=name)


# ---- the results do not depend on the settings -------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "tiled", "torch", "auto"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_settings_change_no_bit_and_stay_as_set(setting, backend, fresh_calls):
    for kind in MASKS:
        if not _runs(backend, kind):
            continue
        fresh_calls()
        want = _call(backend, kind)
        fresh_calls()
        before = torch_state()
        got = _call(backend, kind, settings=SETTINGS[setting])
        assert torch_state() == before
        _assert_same(got, want)
        _assert_near_truth(got, _truth(kind, backend))


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("setting", ["threads", "sdpa_math", "sdpa_flash"])
def test_threads_and_sdpa_kernels_change_no_result(setting, backend, fresh_calls):
    """Another kernel or thread count may sum in another order: the same result within
    float32 rounding, not the same bits."""
    settings = {"threads": lambda: threads(2),
                "sdpa_math": lambda: sdpa_kernel([SDPBackend.MATH]),
                "sdpa_flash": lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION])}[setting]
    for kind in MASKS:
        if not _runs(backend, kind):
            continue
        fresh_calls()
        before = torch_state()
        got = _call(backend, kind, settings=settings)
        assert torch_state() == before
        _assert_near_truth(got, _truth(kind, backend))


def test_triton_interpreted_under_every_setting_at_once(fresh_calls, monkeypatch):
    interpreted_triton_launch()
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (the opt-in, for this test only)
    for kind in ("alibi", "sinks"):
        want = _call("triton", kind)
        fresh_calls()
        got = _call("triton", kind, settings=all_at_once)
        _assert_same(got, want)
        _assert_near_truth(got, _truth(kind, "triton"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_dropout_pattern_ignores_the_default_dtype(backend, dtype, fresh_calls):
    """A generator's seed gives one dropout pattern: the keep-mask draws float32 numbers
    whatever the default dtype (another dtype draws another stream)."""
    def dropped():
        return _call(backend, "causal", dropout_p=0.5,
                     generator=torch.Generator().manual_seed(3))
    want = dropped()
    fresh_calls()
    with default_dtype(dtype):
        got = dropped()
    _assert_same(got, want)


# ---- grad modes ----------------------------------------------------------------------------------

GRAD_OFF = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
            "set_grad_enabled_false": lambda: torch.set_grad_enabled(False)}


@pytest.mark.parametrize("mode", list(GRAD_OFF))
@pytest.mark.parametrize("backend", ["reference", "tiled", "torch"])
def test_a_forward_without_grad_mode_matches_and_records_nothing(mode, backend, fresh_calls):
    for kind in ("causal", "padding_empty_rows", "alibi"):
        want = _call(backend, kind)
        q, k, v = (t.requires_grad_() for t in _inputs())
        fresh_calls()
        with GRAD_OFF[mode]():
            out = ak.attention(q, k, v, _mask(kind), backend=backend)
        assert torch.is_grad_enabled() and not out.requires_grad
        assert torch.equal(out, want["out"])


@pytest.mark.parametrize("backend", ["reference", "tiled", "torch", "auto"])
def test_enable_grad_inside_no_grad_and_a_backward_outside_grad_mode(backend, fresh_calls):
    """A forward under ``enable_grad`` inside ``no_grad`` records its graph; the backward
    runs the same under ``no_grad`` or ``inference_mode``."""
    for kind in ("causal", "padding_empty_rows", "sinks"):
        if not _runs(backend, kind):
            continue
        want = _call(backend, kind, want_lse=False)
        for backward_mode in (torch.no_grad, torch.inference_mode):
            q, k, v = (t.requires_grad_() for t in _inputs())
            fresh_calls()
            with torch.no_grad(), torch.enable_grad():
                out = ak.attention(q, k, v, _mask(kind), backend=backend)
            dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9),
                               dtype=torch.float64).float()
            loss = (out.double() * dout.double()).sum()
            with backward_mode():
                loss.backward()
            assert torch.equal(out.detach(), want["out"])
            assert torch.equal(q.grad, want["dq"]) and torch.equal(v.grad, want["dv"])


# ---- torch.nn.attention.sdpa_kernel ------------------------------------------------------------

@pytest.mark.parametrize("allowed", [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION],
                         ids=lambda b: b.name)
@pytest.mark.parametrize("kind", ["none", "causal", "padding_empty_rows", "bias"])
def test_auto_passes_torch_over_where_sdpa_kernel_allows_no_cpu_kernel(kind, allowed):
    """Code written for CUDA may allow only a CUDA kernel: auto then runs another backend
    (also where the call cache chose torch for the same call before), and explains why."""
    q, k, v = _inputs()
    mask = _mask(kind)
    before = ak.attention(q, k, v, mask)  # (cached: auto's choice outside the context)
    with sdpa_kernel([allowed]):
        out = ak.attention(q, k, v, mask)
        explained = ak.explain_dispatch(q, k, v, mask)
    assert explained.backend != "torch"
    assert any("sdpa_kernel" in why for why in explained.reasons["torch"])
    torch.testing.assert_close(out, before)


@pytest.mark.parametrize("allowed", [SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION],
                         ids=lambda b: b.name)
def test_the_torch_backend_calls_no_flash_kernel_the_context_disallows(allowed):
    """torch's LSE comes from its CPU flash kernel, called past the entry point that reads
    the context: without flash allowed, backend="torch" refuses the LSE and auto takes
    another backend."""
    q, k, v = _inputs()
    truth = ak.attention(*(t.double() for t in (q, k, v)), ak.causal(), return_lse=True,
                         backend="reference")
    ak.attention(q, k, v, ak.causal(), return_lse=True)  # (cached outside the context)
    with sdpa_kernel([allowed]):
        with pytest.raises(ValueError, match="flash kernel, which torch.nn.attention.sdpa_kernel"):
            ak.attention(q, k, v, ak.causal(), backend="torch", return_lse=True)
        assert ak.explain_dispatch(q, k, v, ak.causal(), return_lse=True).backend != "torch"
        result = ak.attention(q, k, v, ak.causal(), return_lse=True)
    torch.testing.assert_close(result.out.double(), truth.out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(result.lse.double(), truth.lse, rtol=1e-5, atol=1e-5)


# ---- KVCache decoding ----------------------------------------------------------------------------

def _decode(settings=contextlib.nullcontext, backend="auto", prefill=300):
    """A prefill of ``prefill`` tokens and 3 decoding steps of ``MultiHeadAttention`` over a
    ``KVCache`` (long enough for its decoding steps' own fused call), without gradients."""
    torch.manual_seed(0)  # (the module's initialisation)
    mha = MultiHeadAttention(16, 4, 2, backend=backend)
    x = torch.randn(2, prefill + 3, 16, generator=torch.Generator().manual_seed(1))
    outs = []
    with settings(), torch.no_grad():
        out, _, cache = mha(x[:, :prefill], cache=KVCache.empty(), is_causal=True,
                            lengths=torch.tensor([prefill, prefill - 7], device=CPU))
        for t in range(prefill, prefill + 3):
            out, _, cache = mha(x[:, t:t + 1], cache=cache, is_causal=True)
            outs.append(out)
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("setting", ["default_float64", "default_meta", "deterministic",
                                     "all_at_once"])
def test_kv_cache_decoding_under_settings(setting, fresh_calls):
    want = _decode()
    fresh_calls()
    before = torch_state()
    got = _decode(SETTINGS[setting])
    assert torch_state() == before
    assert torch.equal(got, want)


def test_kv_cache_decoding_where_sdpa_kernel_allows_no_cpu_kernel():
    """A decoding step's own fused call steps aside, as auto does."""
    want = _decode()
    got = _decode(lambda: sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]))
    torch.testing.assert_close(got, want)


# ---- attnkit's own modes after an exception ----------------------------------------------------

@pytest.mark.parametrize("mode", [lambda: ak.use_backend("reference"), lambda: ak.invariant(),
                                  lambda: ak.use_backend("torch")])
def test_modes_come_back_after_an_exception(mode):
    q, k, v = _inputs()
    before = torch_state()
    with pytest.raises(ValueError):  # bad input inside the block
        with mode():
            ak.attention(q, k[..., :4], v)
    assert torch_state() == before
    with pytest.raises(ValueError):  # a refusal inside nested blocks
        with mode(), ak.use_backend("torch"), ak.invariant():
            ak.attention(q, k, v, return_weights=True)
    assert torch_state() == before
    with pytest.raises(KeyError):  # the caller's own exception
        with mode():
            raise KeyError("caller")
    assert torch_state() == before
    for bad in (lambda: ak.use_backend("nope"), lambda: ak.invariant("yes")):
        with pytest.raises((ValueError, TypeError)):
            with bad():
                pass
        assert torch_state() == before
    torch.testing.assert_close(ak.attention(q, k, v), ak.attention(q, k, v, backend="reference"))


@pytest.mark.parametrize("kind", [ak.causal, lambda: None], ids=["causal", "none"])
def test_a_compiled_auto_call_inside_a_context_allowing_no_cpu_kernel(kind):
    """Eager auto passes torch over under the context; the traced call does too (else its
    graph calls torch's kernel, which refuses under FakeTensor: 'No viable backend')."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=gen) for _ in range(3))
    want = ak.attention(q, k, v, kind())
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: ak.attention(q, k, v, kind()), backend="eager")
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        got = compiled(q, k, v)
    torch.testing.assert_close(got, want)
