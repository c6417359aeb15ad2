"""The invariance contract on ``backend="triton"``, through the Triton interpreter on CPU.

The same bit-for-bit cases as tests/test_invariance.py at the interpreter's sizes (its 32-key
blocks): a sequence alone against right- and left-padded batches, chunked prefills and
decoding steps against one prefill, run to run with gradients (learnable ALiBi slopes
included), and the mutations that must break the checks: the default lists (PARTIAL blocks
first, so a row's key order depends on where its query block starts) and key blocks that
ignore each sequence's first key. The GPU runs the same kernels compiled
(``attnkit check --invariance --device cuda``, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from conftest import import_triton_interpreted, skip_module_unless_interpreted  # noqa: E402

import_triton_interpreted()

import attnkit as ak  # noqa: E402
from attnkit import invariance  # noqa: E402
from attnkit.backends.triton import launch  # noqa: E402
from attnkit.inputs import validate  # noqa: E402
from attnkit.masks import MaskCache  # noqa: E402

from test_invariance import (KINDS, CHUNK_KINDS, _alone_and_in_batch,  # noqa: E402
                             _chunks_against_one_prefill, _equal, _tensors)

skip_module_unless_interpreted(launch, __file__)

LENGTH = 100
"""The checks' sequence length here: several 32-key blocks, a few seconds interpreted."""


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from([k for k in KINDS if k != "score_function"]),
       length=st.integers(1, 70), batch=st.integers(1, 3), place=st.integers(0, 2),
       pad_left=st.sampled_from([0, 1, 37]), pad_right=st.sampled_from([0, 5, 40]),
       group=st.sampled_from([1, 2]), dim=st.sampled_from([16, 64]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_a_sequence_alone_and_in_any_padded_batch_gives_the_same_bits(
        kind, length, batch, place, pad_left, pad_right, group, dim, dtype, seed):
    alone, (out, lse) = _alone_and_in_batch(kind, length, batch, place % batch, pad_left,
                                            pad_right, 1, group, dim, dtype, seed, "triton")
    assert _equal(out, alone.out), invariance.first_difference("out", out, alone.out)
    assert _equal(lse, alone.lse), invariance.first_difference("lse", lse, alone.lse)


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(CHUNK_KINDS), length=st.integers(2, 90),
       cuts=st.lists(st.integers(1, 89), max_size=3), steps=st.integers(0, 2),
       group=st.sampled_from([1, 3]), dim=st.sampled_from([16, 64]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_chunked_prefill_and_decoding_give_the_prefill_bits(kind, length, cuts, steps, group,
                                                            dim, dtype, seed):
    _chunks_against_one_prefill(kind, length, cuts, steps, group, dim, dtype, seed, "triton")


def test_the_checks_hold():
    findings = invariance.check(["triton"], checks=("run to run", "batch", "chunking"),
                                length=LENGTH)
    assert [f.status for f in findings] == ["holds"] * 3, findings


def test_the_cli_table_names_triton_holding_the_contract(capsys):
    from attnkit import cli
    assert cli.main(["check", "--invariance", "--quick", "--backend", "triton"]) == 0
    text = capsys.readouterr().out
    assert text.count("holds") == 3 and "refused" in text  # the ring runs on tiled only


def test_learnable_slopes_get_their_gradient_in_a_fixed_order():
    """The slope gradient goes through one slot per dQ program, summed after: equal bits run
    to run, and the gradient the reference gives."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (_tensors(gen, 2, 4, 70, torch.float32) for _ in range(3))
    slopes = torch.linspace(0.1, 0.8, 4)
    grads = []
    for backend, invariant in (("triton", True), ("triton", True), ("reference", False)):
        leaf = slopes.clone().requires_grad_()
        mask = ak.causal() & ak.alibi(leaf)
        out = ak.attention(q, k, v, mask, backend=backend, invariant=invariant)
        grads.append(torch.autograd.grad(out.square().sum(), leaf)[0])
    assert torch.equal(grads[0], grads[1])
    torch.testing.assert_close(grads[0], grads[2], rtol=1e-4, atol=1e-4)


def test_a_learnable_relative_bias_table_is_refused_with_its_reason():
    q = torch.randn(1, 2, 40, 16)
    table = torch.randn(2, 9, requires_grad=True)
    mask = ak.relative_bias(table, buckets=lambda r: r.clamp(-4, 4) + 4)
    with pytest.raises(ValueError, match="atomics"):
        ak.attention(q, q, q, mask, backend="triton", invariant=True)
    with torch.no_grad():  # without a gradient to sum, the contract holds
        ak.attention(q, q, q, mask, backend="triton", invariant=True)


def test_a_decoding_step_runs_the_forward_kernel_not_the_split_one():
    q, k = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 300, 16)
    inputs = validate(q, k, k, ak.causal("bottom_right"), invariant=True)
    assert launch.decode_form(inputs) is None
    assert launch.decode_form(validate(q, k, k, ak.causal("bottom_right"))) is not None


@pytest.mark.parametrize("mutation", ["lists partial first", "blocks from key 0"])
def test_lists_that_follow_the_call_break_the_checks(monkeypatch, mutation):
    if mutation == "lists partial first":
        monkeypatch.setattr(launch, "key_order_lists", lambda codes, space, sparse_k, starts:
                            launch.block_lists(codes, space.batch, space.heads))
        check = invariance.check_chunking
    else:
        original = launch.key_order_lists
        monkeypatch.setattr(launch, "key_order_lists", lambda codes, space, sparse_k, starts:
                            original(codes, space, sparse_k, None))
        check = invariance.check_batch
    monkeypatch.setattr(launch, "_LAYOUTS", MaskCache(32))  # layouts made under the mutation
    assert check("triton", length=LENGTH), mutation
