"""The reference backend as the exact oracle: one rounding with sinks, NaN gradients into the
non-finite rows themselves; and ``attnkit check``'s bound on a low-precision LSE."""

import pytest
import torch

import attnkit as ak
from attnkit import dispatch
from attnkit.backends.base import BackendOutput
from attnkit.backends.reference import ReferenceBackend
from attnkit.cli import check as check_cmd


# ---- sinks: one rounding ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed, shape", [(0, (2, 3, 17, 17, 16)), (1, (1, 4, 9, 33, 8)),
                                         (2, (2, 2, 40, 24, 32))])
def test_reference_sinks_round_once(dtype, seed, shape):
    """fp16/bf16 inputs with sinks on the reference equal the float64 computation on the same
    inputs, rounded once, bit for bit: out, LSE (float32) and weights."""
    gen = torch.Generator().manual_seed(seed)
    batch, heads, q_len, kv_len, dim = shape
    q = torch.randn(batch, heads, q_len, dim, generator=gen).to(dtype)
    k = torch.randn(batch, heads, kv_len, dim, generator=gen).to(dtype)
    v = torch.randn(batch, heads, kv_len, dim, generator=gen).to(dtype)
    logits = 2 * torch.randn(heads, generator=gen)
    mask = ak.causal("bottom_right") & ak.sinks(logits)
    got = ak.attention(q, k, v, mask, backend="reference", return_lse=True, return_weights=True)
    exact = ak.attention(q.double(), k.double(), v.double(),
                         ak.causal("bottom_right") & ak.sinks(logits.double()),
                         backend="reference", return_lse=True, return_weights=True)
    assert got.out.dtype == got.weights.dtype == dtype and got.lse.dtype == torch.float32
    assert torch.equal(got.out, exact.out.to(dtype))
    assert torch.equal(got.lse, exact.lse.to(torch.float32))
    assert torch.equal(got.weights, exact.weights.to(dtype))


# ---- non-finite rows: their own gradients --------------------------------------------------

def _gradients(backend: str, which: str, row: int, mask, dtype=torch.float64):
    """NaN at ``which``'s row ``row`` (head 0): (out, dq, dk, dv), each ``[B, H, T, D]``."""
    gen = torch.Generator().manual_seed(3)
    tensors = {name: torch.randn(1, 2, 6, 4, generator=gen, dtype=dtype) for name in "qkv"}
    tensors[which][0, 0, row, 1] = float("nan")
    leaves = [tensors[name].clone().requires_grad_() for name in "qkv"]
    out = ak.attention(*leaves, mask, backend=backend)
    grad_out = torch.randn(out.shape, generator=gen, dtype=dtype)
    return (out.detach(), *torch.autograd.grad((out * grad_out).sum(), leaves))


MASKS = {"none": lambda: None, "causal": lambda: ak.causal(),
         "padding": lambda: ak.padding(q_lengths=[5], kv_lengths=[5])}


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("row", [2, 4])
def test_reference_nan_row_gets_a_nan_gradient(mask_name, which, row):
    """A q, k or v row holding NaN that a row attends: its own gradient is NaN on the reference,
    as on tiled; the reference's NaN are where tiled's are (tiled may spread a tile's NaN
    further, as docs/NUMERICS.md allows)."""
    reference = _gradients("reference", which, row, MASKS[mask_name]())
    tiled = _gradients("tiled", which, row, MASKS[mask_name]())
    index = "qkv".index(which)
    assert torch.isnan(reference[1 + index][0, 0, row]).all()
    assert torch.isnan(tiled[1 + index][0, 0, row]).all()
    for mine, theirs in zip(reference, tiled):
        assert not (torch.isnan(mine) & ~torch.isnan(theirs)).any()


def test_reference_nan_rows_no_row_sees_keep_zero_gradients():
    """A fully masked query row holding NaN (by the mask or by a −inf bias row), and K/V rows
    holding NaN that no query may see: output 0, gradients exactly 0 there, no NaN anywhere,
    in a double backward and under torch.func too."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    q[0, 0, 0, 1] = k[0, 0, 3, 0] = v[0, 1, 1, 2] = float("nan")
    q[0, 1, 4, 0] = float("inf")
    allowed = torch.ones(1, 1, 5, 5, dtype=torch.bool)
    allowed[..., 0, :] = allowed[..., 1] = allowed[..., 3] = False  # query 0 sees nothing
    values = torch.zeros(1, 2, 5, 5, dtype=torch.float64)
    values[0, 1, 4] = float("-inf")  # query 4 of head 1 sees nothing either
    mask = ak.dense(allowed) & ak.bias(values)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ak.attention(*leaves, mask, backend="reference")
    assert not torch.isnan(out).any() and (out[0, :, 0] == 0).all() and (out[0, 1, 4] == 0).all()
    grads = torch.autograd.grad((out * torch.randn(out.shape, generator=gen,
                                                   dtype=torch.float64)).sum(),
                                leaves, create_graph=True)
    assert not any(torch.isnan(g).any() for g in grads)
    dq, dk, dv = grads
    assert (dq[0, 0, 0] == 0).all() and (dq[0, 1, 4] == 0).all()
    assert (dk[0, 0, 3] == 0).all() and (dv[0, 1, 1] == 0).all()
    second = torch.autograd.grad(sum((g * g).sum() for g in grads), leaves)
    assert not any(torch.isnan(g).any() for g in second)
    by_func = torch.func.grad(lambda q: ak.attention(q, k, v, mask, backend="reference").sum())(q)
    assert not torch.isnan(by_func).any() and (by_func[0, 0, 0] == 0).all()


def test_reference_nan_query_gradient_under_torch_func():
    """torch.func.grad and vmap take the same path: the NaN query row's gradient is NaN."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    q[0, 1, 2, 3] = float("nan")
    dq = torch.func.grad(lambda q: ak.attention(q, k, v, ak.causal(),
                                                backend="reference").sum())(q)
    assert torch.isnan(dq[0, 1, 2]).all() and not torch.isnan(dq[0, 0]).any()
    batched = torch.func.vmap(torch.func.grad(
        lambda q: ak.attention(q, k[0], v[0], ak.causal(), backend="reference").sum()))(q)
    assert torch.equal(torch.isnan(batched), torch.isnan(dq))


# ---- attnkit check: an LSE in low precision fails -------------------------------------------

class _LowPrecisionLse(ReferenceBackend):
    """A wrong backend: the reference, its LSE rounded to the input dtype (fp16/bf16)."""

    NAME = "low-lse"

    def forward(self, inputs):
        result = super().forward(inputs)
        lse = result.lse.to(inputs.q.dtype).to(result.lse.dtype)
        return BackendOutput(result.out, lse, result.weights)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(check_cmd.QUICK_CASES)))
def test_check_fails_an_lse_rounded_to_the_input_dtype(monkeypatch, dtype, case):
    """Only the LSE measure fails, with an error far above its bound; the real backends
    pass the same case."""
    monkeypatch.setitem(dispatch.BACKENDS, _LowPrecisionLse.NAME, _LowPrecisionLse())
    mask_name, shape = check_cmd.QUICK_CASES[case]
    truth = check_cmd._truth(mask_name, shape, dtype, seed=case)
    result = check_cmd.check_case(_LowPrecisionLse.NAME, mask_name, shape, dtype, seed=case,
                                  truth=truth)
    assert result.status == "FAIL" and result.reason.startswith("lse:")
    lse = result.measure("lse")
    assert lse.error > 4 * lse.bound
    assert result.measure("out").status == "PASS"
    for name in ("reference", "tiled", "torch"):
        real = check_cmd.check_case(name, mask_name, shape, dtype, seed=case, truth=truth)
        assert real.status in ("PASS", "skip"), (name, real.reason)
        assert name != "reference" or real.measure("lse").status == "PASS"
