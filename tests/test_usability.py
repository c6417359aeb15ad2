"""Seeing and steering what runs: explain_dispatch, the attnkit logger, use_backend, autocast,
and the typing promises (py.typed, overloads by flag)."""

from __future__ import annotations

import logging
import typing
from importlib import resources

import pytest
import torch

import attnkit as ak


def _qkv(gen, dtype=torch.float32):
    return torch.randn(3, 1, 2, 8, 16, generator=gen, dtype=dtype).unbind(0)


def test_explain_dispatch_names_the_pick_and_every_reason(gen):
    q, k, v = _qkv(gen)
    long = torch.randn(1, 2, 512, 16, generator=gen)
    picked = ak.explain_dispatch(long, long, long, ak.sliding_window(3))
    assert picked.backend == "tiled"
    assert list(picked.reasons) == ["triton", "torch"]
    assert any("dense" in why for why in picked.reasons["torch"])
    assert str(picked).startswith("auto picks: tiled")
    assert ak.explain_dispatch(q, k, v, ak.sliding_window(3)).backend == "torch"  # 8×8: small
    assert ak.explain_dispatch(q, k, v).backend == "torch"
    leaf = q.clone().requires_grad_()
    assert ak.explain_dispatch(leaf, k, v, return_weights=True).backend == "reference"


def test_explain_dispatch_agrees_with_what_runs(gen, caplog):
    q, k, v = _qkv(gen)
    with caplog.at_level(logging.DEBUG, logger="attnkit"):
        for mask in (None, ak.causal(), ak.padding(kv_lengths=[5]), ak.documents([0] * 4 + [1] * 4)):
            ak.attention(q, k, v, mask)
            assert f"backend {ak.explain_dispatch(q, k, v, mask).backend} " in caplog.records[-1].message
    assert len(caplog.records) == 4  # one line per dispatch


def test_use_backend_forces_auto_in_a_region(gen, caplog):
    q, k, v = _qkv(gen)
    with caplog.at_level(logging.DEBUG, logger="attnkit"):
        with ak.use_backend("reference"):
            ak.attention(q, k, v)
            with ak.use_backend("tiled"):
                ak.attention(q, k, v)
            ak.attention(q, k, v)
            ak.attention(q, k, v, backend="torch")  # an explicit backend wins
        ak.attention(q, k, v)
    ran = [r.message.split()[2] for r in caplog.records]
    assert ran == ["reference", "tiled", "reference", "torch", "torch"]


def test_explain_dispatch_tells_what_use_backend_runs(gen):
    q, k, v = _qkv(gen)
    assert not ak.explain_dispatch(q, k, v).forced
    with ak.use_backend("tiled"):
        told = ak.explain_dispatch(q, k, v)
        assert (told.backend, told.forced) == ("tiled", True)
        assert str(told).startswith("use_backend('tiled') runs: tiled")
    with ak.use_backend("torch"):
        told = ak.explain_dispatch(q, k, v, return_weights=True)
        assert told.backend is None and "return_weights" in str(told.reasons["torch"])


def test_use_backend_that_cannot_run_raises_with_reasons(gen):
    q, k, v = _qkv(gen)
    with pytest.raises(ValueError, match="unknown backend"):
        with ak.use_backend("flash"):
            pass
    with ak.use_backend("torch"), pytest.raises(ValueError, match="return_weights"):
        ak.attention(q, k, v, return_weights=True)


def test_autocast_runs_in_the_autocast_dtype(gen):
    q, k, v = _qkv(gen)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match="dtype"):
        ak.attention(q, k.double(), v)  # float64 is not cast (as autocast does), so they differ
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ak.attention(q, k, v, ak.causal())
        tiled = ak.attention(q, k, v, ak.causal(), backend="tiled")
    assert out.dtype == tiled.dtype == torch.bfloat16
    want = ak.attention(*(t.bfloat16() for t in (q, k, v)), ak.causal())
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(tiled, want, atol=1e-2, rtol=0)


def test_every_entry_point_takes_autocast_as_attention_does(gen):
    """varlen_attention casts as attention() does, and explain_dispatch tells the backend the
    cast call runs (an fp32 bias refused by torch with bf16 inputs)."""
    q, k, v = _qkv(gen)
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]  # [T, H, D]
    length = packed[0].shape[0]
    bias = ak.bias(torch.zeros(1, 1, q.shape[2], k.shape[2]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ak.varlen_attention(packed[0], packed[1].bfloat16(), packed[2], [0, length])
        assert out.dtype == torch.bfloat16
        picked = ak.explain_dispatch(q, k, v, bias).backend
        with ak.use_backend(picked):
            ak.attention(q, k, v, bias)  # runs where explain_dispatch said
    assert picked != "torch"


def test_mixed_dtypes_outside_autocast_say_how_to_fix(gen):
    q, k, v = _qkv(gen)
    with pytest.raises(TypeError, match=r"share one dtype.*k\.to\(q\.dtype\)"):
        ak.attention(q, k.bfloat16(), v)


def test_typing_promises():
    assert resources.files("attnkit").joinpath("py.typed").is_file()
    overloads = typing.get_overloads(ak.attention)
    returns = [typing.get_type_hints(o)["return"] for o in overloads]
    assert returns[:3] == [torch.Tensor, ak.AttentionResult, ak.AttentionResult]


def test_tiled_backward_inside_autocast_equals_outside(gen):
    q, k, v = _qkv(gen)
    grads = []
    for inside in (True, False):
        leaf = q.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ak.attention(leaf, k, v, ak.sliding_window(3), backend="tiled")
            if inside:
                out.float().sum().backward()
        if not inside:
            out.float().sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=0, rtol=0)


def test_importing_attnkit_leaves_triton_unimported():
    """``TRITON_INTERPRET`` is read when triton is first imported: importing attnkit (and its
    submodules) must leave that to the first triton call, or the user's opt-in set after
    ``import attnkit`` would be ignored."""
    import subprocess
    import sys
    code = ("import sys, attnkit, attnkit.nn, attnkit.distributed, attnkit.compiled; "
            "print('triton' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "False"
