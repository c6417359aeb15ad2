"""Numerical extremes on every CPU backend against the float64 truth (the 2× rule of
docs/NUMERICS.md), and the bits of a call across fresh processes (hash seed, thread count)."""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys

import pytest
import torch

import attnkit as ak
from conftest import (assert_within_2x, attention_math, delta_form_floors, dense_causal, make_qkv,
                      naive_attention)

BACKENDS = ("reference", "tiled", "torch", "auto")


def _cases():
    """name → (q, k, v, mask, allowed, bias, scale) on small shapes."""
    gen = torch.Generator().manual_seed(11)
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    cases = {}
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, 16, f32, gen)
    cases["fp32 q,k ~1e3"] = (q * 1e3, k * 1e3, v, None, None, None, None)
    for dtype in (f16, bf16):  # unscaled fp16 scores reach ~1e5 > 65504
        q, k, v = make_qkv(1, 2, 2, 8, 8, 16, 16, dtype, gen)
        cases[f"{dtype} q,k ~200 causal"] = (q * 200, k * 200, v, ak.causal(), dense_causal(8, 8),
                                             None, None)
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, 16, f16, gen)
    v = (60000 + 5000 * torch.rand(v.shape, generator=gen)).to(f16)
    cases["fp16 v ~60000"] = (q, k, v, None, None, None, None)
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, 16, f32, gen)
    cases["fp32 scale 1e-6"] = (q, k, v, None, None, None, 1e-6)
    tiny = torch.finfo(f16).tiny / 4
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, 16, f16, gen)
    cases["fp16 subnormal"] = ((q * tiny).to(f16), (k * tiny).to(f16), (v * tiny).to(f16), None,
                               None, None, None)
    for dk in (1, 3, 257):
        q, k, v = make_qkv(1, 2, 2, 8, 8, dk, dk, f32, gen)
        cases[f"fp32 head dim {dk}"] = (q, k, v, ak.causal(), dense_causal(8, 8), None, None)
    q, k, v = make_qkv(1, 2, 2, 300, 3, 16, 16, bf16, gen)
    cases["bf16 Tq >> Tk"] = (q, k, v, ak.causal(align="bottom_right"),
                              dense_causal(300, 3, "bottom_right"), None, None)
    q, k, v = make_qkv(2, 64, 1, 4, 8, 8, 8, f32, gen)
    cases["fp32 GQA group 64"] = (q, k, v, None, None, None, None)
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, 16, torch.float64, gen)
    cases["fp64 q,k ~1e150"] = (q * 1e150, k * 1e150, v, None, None, None, None)
    for dtype in (f16, bf16):
        q, k, v = make_qkv(1, 2, 2, 6, 8, 16, 16, dtype, gen)
        hidden = torch.rand(1, 1, 6, 8, generator=gen) < 0.4
        hidden[..., 0] = False
        bias = torch.zeros(1, 1, 6, 8, dtype=dtype).masked_fill(hidden, torch.finfo(dtype).min)
        cases[f"{dtype} finfo.min bias"] = (q, k, v, bias, None, bias, None)
    return cases


CASES = _cases()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_extreme_inputs_within_the_contract(name, backend):
    q, k, v, mask, allowed, bias, scale = CASES[name]
    dtype = q.dtype
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    try:
        out = ak.attention(*leaves, mask=mask, scale=scale, backend=backend)
    except ValueError as error:  # a refusal must say which backend and why
        assert backend in str(error) and "not supported" in str(error), str(error)
        return
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    gen = torch.Generator().manual_seed(3)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dtype)
    truth = [t.detach().double().requires_grad_() for t in (q, k, v)]
    plain = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out_true, _ = attention_math(*truth, allowed, bias, scale, torch.float64)
    out_plain, _ = attention_math(*plain, allowed, bias, scale, dtype)
    assert torch.isfinite(out).all()
    assert_within_2x("out", out, out_true, out_plain, dtype)
    got = torch.autograd.grad(out, leaves, dout)
    want = torch.autograd.grad(out_true, truth, dout.double())
    base = torch.autograd.grad(out_plain, plain, dout)
    floors = ({} if backend == "reference"
              else delta_form_floors(q, k, v, dout, allowed, bias, scale))
    for part, g, t, p in zip(("dq", "dk", "dv"), got, want, base):
        assert torch.isfinite(g).all(), part
        assert_within_2x(part, g, t, p, dtype, floors.get(part, 0.0))


def test_rows_of_only_huge_negative_bias_are_finite():
    """A row whose scores are all −1e30 (a bias, not a mask) has a finite LSE near −1e30."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = make_qkv(1, 2, 2, 4, 8, 16, 16, torch.float32, gen)
    bias = torch.zeros(1, 1, 4, 8)
    bias[..., 2:, :] = -1e30
    _, lse_true, _ = naive_attention(q, k, v, bias=bias)
    for backend in ("reference", "tiled", "torch"):
        result = ak.attention(q, k, v, bias, backend=backend, return_lse=True)
        assert torch.isfinite(result.out).all() and torch.isfinite(result.lse).all(), backend
        assert torch.allclose(result.lse.double(), lse_true, rtol=1e-6), backend


_BITS = r"""
import hashlib, sys, torch, attnkit as ak
torch.set_num_threads(int(sys.argv[1]))
g = torch.Generator().manual_seed(1)
B, H, Hkv, T, D = 2, 4, 2, 300, 32
base = [torch.randn(s, generator=g) for s in ((B, H, T, D), (B, Hkv, T, D), (B, Hkv, T, D))]
dout = torch.randn(B, H, T, D, generator=g)
ids = torch.sort(torch.randint(0, 4, (B, T), generator=g), dim=-1).values
masks = [ak.documents(ids), ak.padding(kv_lengths=torch.tensor([T, 200])) & ak.causal(),
         ak.sliding_window(17) & ak.causal(),
         ak.from_function(lambda b, h, i, j: ((i - j) % 5 != 3) & (j <= i))]
digest = hashlib.sha256()
for backend, invariant in (("tiled", False), ("tiled", True), ("reference", None)):
    for mask in masks:
        leaves = [t.clone().requires_grad_() for t in base]
        r = ak.attention(*leaves, mask=mask, backend=backend, invariant=invariant, return_lse=True)
        for t in (r.out, r.lse, *torch.autograd.grad(r.out, leaves, dout)):
            digest.update(t.detach().contiguous().numpy().tobytes())
print(digest.hexdigest())
"""


def test_bits_do_not_depend_on_the_process():
    """Fresh processes with other hash seeds and thread counts print the same bits."""
    digests = set()
    for seed, threads in (("0", "1"), ("4242", "2")):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run([sys.executable, "-c", _BITS, threads], env=env, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        digests.add(run.stdout.strip())
    assert len(digests) == 1, digests
