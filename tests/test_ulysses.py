"""Ulysses attention across processes: multi-process gloo on CPU, compared in float64 with
single-process ``attention(..., backend="reference")`` on the whole sequence.

Each world size is started once (``spawn``, cached per module) and one worker runs every case
in it; a case's failed assertion is recorded with its message and raised by the pytest test
of that case. H = 12 query heads, so worlds 2, 3 and 4 all divide it; the local shards are
5 positions long (7 for the keys of cross-attention).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import attnkit as ak
from attnkit.distributed import shard, spawn
from conftest import backward_unless_rank_1, error_failures, spawned_once
from attnkit.distributed.ulysses import (heads_of, kv_head_index, ulysses_attention,
                                         ulysses_bytes)

WORLD_SIZES = (2, 3, 4)
HEADS, BATCH, DK, DV = 12, 2, 8, 6
LOCAL_Q, LOCAL_KV_CROSS = 5, 7
TOL = dict(rtol=1e-9, atol=1e-9)  # float64: partial results differ by rounding only

MASKS = ("none", "causal", "window", "documents&causal", "padding", "alibi&causal",
         "alibi_batched", "bias_per_head&causal", "dense_per_head", "relative&softcap",
         "sinks&causal", "causal_cross")
LEARNABLE = {"alibi&causal": "slopes", "alibi_batched": "slopes_batched",
             "relative&softcap": "table", "sinks&causal": "logits"}


def _cases() -> list[dict]:
    cases = [dict(mask=m, kv_heads=HEADS) for m in MASKS]
    cases += [dict(mask="causal", kv_heads=kv) for kv in (1, 2, 3, 4, 6)]  # GQA / MQA
    cases.append(dict(mask="alibi&causal", kv_heads=1))  # MQA with per-head slopes
    cases.append(dict(mask="documents&causal", kv_heads=3, no_lse=True))  # plain tensor out
    return cases


def case_name(case: dict) -> str:
    return f"{case['mask']}-hkv{case['kv_heads']}" + ("-no_lse" if case.get("no_lse") else "")


CASES = _cases()


# ---- one case on one rank ---------------------------------------------------------------------

def _params(gen: torch.Generator) -> dict:
    return dict(slopes=torch.rand(HEADS, generator=gen, dtype=torch.float64),
                slopes_batched=torch.rand(BATCH, HEADS, generator=gen, dtype=torch.float64),
                table=torch.randn(HEADS, 32, generator=gen, dtype=torch.float64),
                logits=torch.randn(HEADS, generator=gen, dtype=torch.float64))


def _mask(kind: str, tq: int, tk: int, gen: torch.Generator, params: dict):
    """The mask of the whole sequence; ``params`` holds the learnable tensors it uses."""
    if kind == "none":
        return None
    if kind == "causal":
        return ak.causal()
    if kind == "causal_cross":
        return ak.causal("bottom_right")
    if kind == "window":
        return ak.sliding_window(left=3, right=1)
    if kind == "documents&causal":
        ids = torch.randint(0, 4, (tq,), generator=gen).sort().values
        return ak.documents(ids) & ak.causal()
    if kind == "padding":  # batch 0: no keys (fully masked rows); batch 1: padded queries
        return ak.padding(q_lengths=[tq, tq - 3], kv_lengths=[0, tk - 2])
    if kind == "alibi&causal":
        return ak.causal() & ak.alibi(params["slopes"])
    if kind == "alibi_batched":
        return ak.alibi(params["slopes_batched"])
    if kind == "bias_per_head&causal":
        return ak.bias(torch.randn(1, HEADS, tq, tk, generator=gen, dtype=torch.float64)) \
            & ak.causal()
    if kind == "dense_per_head":
        allowed = torch.rand(HEADS, tq, tk, generator=gen) < 0.6
        allowed[..., 0] = True  # every row has a key
        return ak.dense(allowed)
    if kind == "relative&softcap":
        return ak.relative_bias(params["table"]) & ak.softcap(3.0)
    if kind == "sinks&causal":
        return ak.sinks(params["logits"]) & ak.causal()
    raise KeyError(kind)


def _loss(out, lse, grad_out, grad_lse):
    """Σ out·g (+ Σ lse·h over finite lse): a loss whose gradient reaches every input."""
    total = (out * grad_out).sum()
    if lse is not None:
        total = total + torch.where(torch.isfinite(lse), lse, 0.0).mul(grad_lse).sum()
    return total


def _run_case(case: dict, rank: int, world: int) -> None:
    """Assert this rank's out, lse, dq, dk, dv (and the learnable tensors' gradients, summed
    over the group) against the whole-sequence reference."""
    seed = sum(map(ord, case_name(case))) * 7919 + world
    gen = torch.Generator().manual_seed(seed)
    kind, kv_heads = case["mask"], case["kv_heads"]
    tq = LOCAL_Q * world
    tk = LOCAL_KV_CROSS * world if kind == "causal_cross" else tq
    q = torch.randn(BATCH, HEADS, tq, DK, generator=gen, dtype=torch.float64)
    k = torch.randn(BATCH, kv_heads, tk, DK, generator=gen, dtype=torch.float64)
    v = torch.randn(BATCH, kv_heads, tk, DV, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(BATCH, HEADS, tq, DV, generator=gen, dtype=torch.float64)
    grad_lse = torch.randn(BATCH, HEADS, tq, generator=gen, dtype=torch.float64)
    params = _params(gen)
    with_lse = not case.get("no_lse")

    def build():  # the mask around fresh learnable copies of the params
        fresh = {name: p.detach().clone().requires_grad_() for name, p in params.items()}
        return _mask(kind, tq, tk, torch.Generator().manual_seed(seed + 1), fresh), fresh

    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    mask, truth_params = build()
    truth = ak.attention(*whole, mask, backend="reference", return_lse=True)
    _loss(truth.out, truth.lse if with_lse else None, grad_out, grad_lse).backward()

    local = [shard(t, rank, world).requires_grad_() for t in (q, k, v)]
    mask, ours_params = build()
    result = ulysses_attention(*local, mask, return_lse=with_lse)
    if with_lse:
        assert isinstance(result, ak.AttentionResult) and result.weights is None
        out, lse = result.out, result.lse
    else:
        assert isinstance(result, torch.Tensor)
        out, lse = result, None
    _loss(out, lse, shard(grad_out, rank, world), shard(grad_lse, rank, world, dim=-1)).backward()

    torch.testing.assert_close(out, shard(truth.out, rank, world), **TOL, msg=lambda m: f"out: {m}")
    if with_lse:
        torch.testing.assert_close(lse, shard(truth.lse, rank, world, dim=-1), **TOL,
                                   msg=lambda m: f"lse: {m}")
    for name, ours, theirs in zip(("dq", "dk", "dv"), local, whole):
        torch.testing.assert_close(ours.grad, shard(theirs.grad, rank, world), **TOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
    if kind in LEARNABLE:  # each rank holds its heads' share: summed over the group
        name = LEARNABLE[kind]
        total = ours_params[name].grad.clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total, truth_params[name].grad, **TOL,
                                   msg=lambda m: f"d{name}: {m}")
    if kind == "padding":  # batch 0 has no keys: exactly 0 out, −inf lse, 0 gradients
        assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
        assert (local[0].grad[0] == 0).all()


# ---- error cases: every rank raises, nobody hangs ---------------------------------------------

def _error_cases(rank: int, world: int) -> dict:
    def shards(heads=HEADS, length=LOCAL_Q, kv_heads=None):
        return [torch.randn(1, h, length, DK, dtype=torch.float64)
                for h in (heads, kv_heads or heads, kv_heads or heads)]

    bad_heads = world + 1  # 3, 4, 5: not a multiple of 2, 3, 4
    longer = LOCAL_Q + (2 if rank == world - 1 else 0)
    cases = {
        "heads_not_divisible": (lambda: ulysses_attention(*shards(bad_heads)), ValueError,
                                [f"H={bad_heads}", f"P={world}", "ring_attention"]),
        "shard_lengths_differ": (lambda: ulysses_attention(*shards(length=longer)), ValueError,
                                 ["disagree", "shapes", f"{longer}", "equal"]),
        "not_4d": (lambda: ulysses_attention(*(t[0] for t in shards())), ValueError,
                   ["[B, H, T/P, D]", f"({HEADS}, {LOCAL_Q}, {DK})"]),
        "score_function": (lambda: ulysses_attention(
            *shards(), ak.causal() & ak.score_function(lambda s, b, h, i, j: s + h)),
            ValueError, ["score_function", "head"]),
        "from_function": (lambda: ulysses_attention(
            *shards(), ak.from_function(lambda b, h, i, j: (h % 2 == 0) | (i >= j))),
            ValueError, ["from_function", "head"]),
        "mask_differs": (lambda: ulysses_attention(  # named as the masks, not digests alone
            *shards(), ak.causal() & ak.softcap(5.0 + (rank == world - 1))), ValueError,
            ["disagree on mask", "softcap(5.0)", "softcap(6.0)"]),
        "return_weights": (lambda: ulysses_attention(*shards(), return_weights=True),
                           ValueError, ["weights"]),
        "local_document_ids": (lambda: ulysses_attention(
            *shards(), ak.documents(torch.zeros(LOCAL_Q, dtype=torch.long))),
            ValueError, ["global positions", f"{LOCAL_Q * world}"]),
    }
    return error_failures(cases)


# ---- bytes sent, counted at the all-to-all ----------------------------------------------------

def _measured_bytes(rank: int, world: int) -> dict:
    """Bytes this rank sent to others (forward, backward) in one call with replicated K/V
    heads and the LSE, counted by wrapping ``all_to_all_single``; and ``ulysses_bytes``."""
    sent = [0]
    original = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        sent[0] += input.numel() * input.element_size() * (world - 1) // world
        return original(output, input, *args, **kwargs)

    kv_heads = 2 if world == 4 else 1
    gen = torch.Generator().manual_seed(world)
    q = torch.randn(BATCH, HEADS, LOCAL_Q, DK, generator=gen, dtype=torch.float64,
                    requires_grad=True)
    k = torch.randn(BATCH, kv_heads, LOCAL_Q, DK, generator=gen, dtype=torch.float64,
                    requires_grad=True)
    v = torch.randn(BATCH, kv_heads, LOCAL_Q, DV, generator=gen, dtype=torch.float64,
                    requires_grad=True)
    dist.all_to_all_single = counting
    try:
        result = ulysses_attention(q, k, v, ak.causal(), return_lse=True)
        forward = sent[0]
        _loss(result.out, result.lse, torch.ones_like(result.out),
              torch.ones_like(result.lse)).backward()
        backward = sent[0] - forward
    finally:
        dist.all_to_all_single = original
    expected = ulysses_bytes(q.shape, k.shape, v.shape, world, 8, return_lse=True,
                             lse_element_size=8)
    return dict(forward=forward, backward=backward, expected=expected)


# ---- the worker -------------------------------------------------------------------------------

def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    failures = {}
    for case in CASES:
        try:
            _run_case(case, rank, world)
            failures[case_name(case)] = None
        except AssertionError as error:
            failures[case_name(case)] = str(error) or "assertion failed"
    errors = _error_cases(rank, world)
    after = None  # the group still works after the errors: nobody was left in a collective
    try:
        _run_case(dict(mask="causal", kv_heads=3), rank, world)
    except AssertionError as error:
        after = str(error)
    return dict(failures=failures, errors=errors, after_errors=after,
                bytes=_measured_bytes(rank, world))


def run_world(world: int) -> list[dict]:
    """Every rank's results for ``world`` processes (started once per test run)."""
    return spawned_once(_worker, world)


# ---- the tests --------------------------------------------------------------------------------

@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", CASES, ids=case_name)
def test_matches_single_process_attention(world, case):
    """out, lse, dq, dk, dv (and learnable modifier gradients) of every rank's shard equal the
    whole-sequence float64 reference."""
    name = case_name(case)
    problems = [f"rank {rank}: {r['failures'][name]}" for rank, r in enumerate(run_world(world))
                if r["failures"][name]]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_bad_input_raises_on_every_rank(world):
    problems = [f"rank {rank} {name}: {failure}" for rank, r in enumerate(run_world(world))
                for name, failure in r["errors"].items() if failure]
    problems += [f"rank {rank} after errors: {r['after_errors']}"
                 for rank, r in enumerate(run_world(world)) if r["after_errors"]]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_bytes_sent_match_ulysses_bytes(world):
    for rank, r in enumerate(run_world(world)):
        measured, expected = r["bytes"], r["bytes"]["expected"]
        assert measured["forward"] == expected["forward"] > 0, (rank, measured)
        assert measured["backward"] == expected["backward"], (rank, measured)


def test_ulysses_bytes_counts_each_tensor():
    # P = 4, B = 2, H = 8, Hkv = 8 (2 per rank), T/P = 16, Dk = 32, Dv = 16, fp16
    sent = ulysses_bytes((2, 8, 16, 32), (2, 8, 16, 32), (2, 8, 16, 16), 4, 2)
    assert sent["q"] == 3 * 2 * 2 * 16 * 32 * 2
    assert sent["k"] == 3 * 2 * 2 * 16 * 32 * 2
    assert sent["v"] == sent["out"] == 3 * 2 * 2 * 16 * 16 * 2
    assert sent["lse"] == 0
    assert sent["forward"] == sent["backward"] == sent["q"] + sent["k"] + sent["v"] + sent["out"]
    # MQA: every rank receives the one K/V head whole (P − 1 of its P shards from others)
    mqa = ulysses_bytes((2, 8, 16, 32), (2, 1, 16, 32), (2, 1, 16, 32), 4, 2, return_lse=True)
    assert mqa["k"] == 3 * 2 * 1 * 16 * 32 * 2
    assert mqa["lse"] == 3 * 2 * 2 * 16 * 4
    with pytest.raises(ValueError, match="H=6.*P=4"):
        ulysses_bytes((1, 6, 4, 8), (1, 6, 4, 8), (1, 6, 4, 8), 4, 2)


@pytest.mark.parametrize("heads,kv_heads,world", [(12, 12, 4), (12, 4, 2), (12, 1, 4),
                                                  (12, 2, 4), (12, 6, 4), (12, 4, 3),
                                                  (12, 2, 3), (8, 2, 4)])
def test_kv_head_index_gives_each_query_head_its_kv_head(heads, kv_heads, world):
    index = kv_head_index(heads, kv_heads, world)  # [P, n]
    local = heads // world
    group = heads // kv_heads
    assert local % index.shape[1] == 0
    per_kv = local // index.shape[1]
    for rank in range(world):
        for i in range(local):  # local query head i reads local K/V head i // per_kv
            assert int(index[rank, i // per_kv]) == (rank * local + i) // group
    if kv_heads % world == 0:  # sharded: every K/V head on exactly one rank
        assert sorted(index.reshape(-1).tolist()) == list(range(kv_heads))


def test_heads_of_narrows_per_head_tensors_and_refuses_functions():
    slopes, table = torch.arange(8.0), torch.arange(8.0)[:, None].expand(8, 4).contiguous()
    bias = torch.arange(8.0)[None, :, None, None].expand(1, 8, 3, 3)
    mask = ak.causal() & ak.bias(bias)
    sliced = heads_of(mask, 4, 2, 8)
    assert torch.equal(sliced.parts[1].values, bias[:, 4:6])
    assert sliced.parts[0] is mask.parts[0]  # causal is the same for every head
    assert torch.equal(heads_of(ak.alibi(slopes), 2, 2, 8).slopes, slopes[2:4])
    assert torch.equal(heads_of(ak.relative_bias(table), 6, 2, 8).table, table[6:8])
    assert torch.equal(heads_of(ak.sinks(slopes), 0, 4, 8).logits, slopes[:4])
    with pytest.raises(ValueError, match="from_function"):
        heads_of(ak.causal() & ak.from_function(lambda b, h, i, j: i >= j), 0, 4, 8)


def test_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="process group"):
        ulysses_attention(q, q, q)



# ---- a rank that skips the backward: named within backward_timeout ----------------------------

SKIP_TIMEOUT = 2.0  # seconds; the group's own timeout is spawn's 60 s


def _skips_backward(rank: int, world: int, log_dir: str) -> None:
    """Rank 1 never calls backward; the others run it and record the error they get."""
    q, k, v = (torch.randn(1, 2, 8, 8, requires_grad=True) for _ in range(3))
    out = ulysses_attention(q, k, v, ak.causal(), backward_timeout=SKIP_TIMEOUT)
    backward_unless_rank_1(out, rank, log_dir)
    raise AssertionError(f"rank {rank}: the backward finished although rank 1 skipped it")


def test_a_rank_that_skips_the_backward_is_named_within_the_backward_timeout(tmp_path):
    """2 ranks, rank 1 skips the backward: rank 0 raises the backward_timeout's error (2 s),
    naming rank 1 and the fix, instead of waiting in the all-to-all for the group timeout."""
    with pytest.raises(Exception, match="did not run the backward"):
        spawn(_skips_backward, 2, str(tmp_path))
    message = Path(tmp_path, "rank0.txt").read_text()
    assert "rank 1 of its all-to-all group did not run the backward" in message, message
    assert "every rank must backpropagate through its output" in message, message


def test_backward_timeout_must_be_a_positive_number():
    q = torch.randn(1, 2, 4, 8)
    for bad in (0, -1.0, float("inf"), True, "2"):
        with pytest.raises(ValueError, match="backward_timeout="):
            ulysses_attention(q, q, q, backward_timeout=bad)
