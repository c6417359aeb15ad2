"""Ring attention across processes: multi-process gloo on CPU, compared with single-process
``attention(..., backend="reference")`` (float64) on the whole sequence.

Starting processes is slow (each imports torch), so every world size is started ONCE
(``spawn``, module-scoped cache) and one worker function runs every case inside it. Workers
``assert`` themselves; a case's failed assertion is recorded with its message and re-raised by
the pytest test of that case, any other exception in a worker fails ``spawn`` (and with it
every test of that world size).

Tolerances: float64 must match to 1e-9 (merging P partial results in fp64 costs ~1e-15).
float32 and bfloat16 follow the project's rule (tests/conftest.py): error ≤ 2 × the error of
plain PyTorch math in that dtype on the whole sequence + a floor of 8 ulps (fp32) / 1 ulp (bf16)
of the largest value — the ring sums in another order (per tile, then per step through the fp32
LSE merge), which costs a few ulps, not more.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from pathlib import Path

import pytest
import torch

import attnkit as ak
from attnkit.distributed import PeakMemory, RingStats, ring_attention, shard, spawn, unshard

WORLD_SIZES = (1, 2, 3, 4)
LAYOUTS = ("contiguous", "zigzag")
MASKS = ("none", "causal", "causal_cross", "causal_bottom_right", "documents&causal", "padding",
         "window", "dense", "bool_tensor", "bias&causal", "sinks&padding", "alibi&causal",
         "softcap&relative&documents")
MODIFIED = ("alibi&causal", "softcap&relative&documents")  # with learnable modifiers
FP32_MASKS = ("none", "causal", "causal_bottom_right", "documents&causal", "padding", "window")
BF16_MASKS = ("causal", "padding")  # low precision: the engine's matmul path, fp32 merging
CHUNK = 8  # rows per zigzag chunk: the global sequence is 2P chunks
BLOCK_Q, BLOCK_K = 8, 4  # key blocks narrower than a chunk: masks skip tiles inside a step too

# ---- cases ------------------------------------------------------------------------------------


def _cases() -> list[dict]:
    cases = [dict(mask=m, layout=lay, dtype=torch.float64) for m in MASKS for lay in LAYOUTS]
    cases += [dict(mask=m, layout=lay, dtype=torch.float32) for m in FP32_MASKS for lay in LAYOUTS]
    cases += [dict(mask=m, layout=lay, dtype=torch.bfloat16) for m in BF16_MASKS for lay in LAYOUTS]
    for layout in LAYOUTS:  # gradient through the LSE too (tiles leave the fused kernel)
        cases.append(dict(mask="causal", layout=layout, dtype=torch.float64, lse_loss=True))
        cases.append(dict(mask="causal", layout=layout, dtype=torch.float64, heads_kv=4, dv=6))
        cases.append(dict(mask="causal", layout=layout, dtype=torch.float64, heads_kv=4, rank3=True))
    return cases


def _triton_cases() -> list[dict]:
    """Steps on the triton kernels (interpreted): world 2 every mask and layout; world 3 those
    whose shards cut the mask's structure most (``TRITON_WORLD3``)."""
    cases = [dict(mask=m, layout=lay, dtype=torch.float32, backend="triton") for m in MASKS
             for lay in LAYOUTS]
    cases += [dict(mask="causal", layout="zigzag", dtype=torch.float32, backend="triton", **extra)
              for extra in (dict(lse_loss=True), dict(heads_kv=4, dv=6), dict(heads_kv=1))]
    cases.append(dict(mask="causal", layout="zigzag", dtype=torch.bfloat16, backend="triton"))
    return cases


def case_name(case: dict) -> str:
    extras = [key for key in ("lse_loss", "rank3") if case.get(key)]
    if "dv" in case:  # MHA (no GQA) with Dv != Dk: the engine's matmul path
        extras.append("mha_dv6")
    if case.get("heads_kv") == 1:
        extras.append("mqa")
    if "backend" in case:
        extras.append(case["backend"])
    return "-".join([case["mask"], case["layout"], str(case["dtype"]).replace("torch.", ""), *extras])


CASES = _cases()
TRITON_CASES = _triton_cases()
TRITON_WORLD3 = ("causal-zigzag", "documents&causal-zigzag", "padding-zigzag", "dense-contiguous",
                 "causal_cross-contiguous", "window-zigzag")


def _mask(kind: str, tq: int, tk: int, batch: int, gen: torch.Generator):
    """The mask of the whole sequence (global positions)."""
    if kind == "none":
        return None
    if kind in ("causal", "causal_cross"):
        return ak.causal()
    if kind == "causal_bottom_right":
        return ak.causal("bottom_right")
    if kind == "documents&causal":
        ids = torch.randint(0, 5, (tq,), generator=gen).sort().values
        return ak.documents(ids) & ak.causal()
    if kind == "padding":  # batch 0: no keys at all (fully masked rows); batch 1: padded queries
        return ak.padding(q_lengths=[tq, tq - 5], kv_lengths=[0, tk - 3])
    if kind == "window":
        return ak.sliding_window(left=5, right=2)
    if kind == "dense":  # a global-size tensor: tiles must index it at global positions
        return ak.dense(torch.rand(tq, tk, generator=gen) < 0.6)
    if kind == "bool_tensor":  # a tensor as mask=, built on each rank: equal contents agree
        return torch.rand(tq, tk, generator=gen) < 0.6
    if kind == "bias&causal":
        return ak.bias(torch.randn(batch, 1, tq, tk, generator=gen, dtype=torch.float64)) & ak.causal()
    if kind == "sinks&padding":  # batch 0 has no keys: its rows put their weight on the sinks
        return ak.sinks(torch.linspace(-1.0, 1.0, 4)) & ak.padding(kv_lengths=[0, tk - 3])
    raise KeyError(kind)


def _modified_mask(kind: str, tq: int, params: list) -> object:
    """A MODIFIED mask over ``tq`` queries around the learnable ``params`` (slopes [H], table
    [H, 32]): bottom-right causal ALiBi (Tk ≠ Tq), or documents with a softcap and a T5
    relative bias."""
    slopes, table = params
    if kind == "alibi&causal":
        return ak.causal("bottom_right") & ak.alibi(slopes, align="bottom_right")
    return ak.documents(torch.arange(tq) // 7) & ak.softcap(2.0) & ak.relative_bias(table)


def _plain_math(q, k, v, mask, scale):
    """Plain PyTorch math in q's dtype on the whole sequence (the yardstick of the 2× rule):
    ``(out, lse)``, differentiable; a row with no key gives out 0, lse −inf, zero gradients."""
    batch, heads, tq, _ = q.shape
    tk = k.shape[2]
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [B, Hq, Tk, D]
    scores = q @ k.transpose(-1, -2) * scale  # [B, Hq, Tq, Tk]
    allowed = torch.ones(1, 1, tq, tk, dtype=torch.bool)
    mask, modifiers = ak.modifiers.split(ak.masks.as_mask(mask))  # a tensor passed as mask=
    if modifiers is not None and modifiers.changes_scores:
        space = ak.masks.MaskSpace(batch, heads, tq, tk)
        scores = modifiers.apply(scores, torch.arange(tq), torch.arange(tk), space)
    if mask is not None:
        space = ak.masks.MaskSpace(batch, heads, tq, tk)
        allowed = mask.to_dense(space)
        bias = mask.dense_bias(space)
        if bias is not None:
            scores = scores + bias.to(scores.dtype)
    allowed = allowed.expand(scores.shape)
    empty = ~allowed.any(-1, keepdim=True)  # [B, Hq, Tq, 1]
    scores = scores.masked_fill(~allowed | empty, float("-inf")).masked_fill(empty, 0.0)
    weights = torch.softmax(scores, -1).masked_fill(empty, 0.0)
    lse = torch.logsumexp(scores, -1).masked_fill(empty[..., 0], float("-inf"))
    if modifiers is not None and modifiers.sinks is not None:
        out, lse, _ = modifiers.sinks.join(weights @ v, lse)
        return out, lse
    return weights @ v, lse


def _loss(out, lse, grad_out, grad_lse):
    """Σ out·g (+ Σ lse·h over finite lse): a loss whose gradient reaches every input."""
    total = (out * grad_out).sum()
    if grad_lse is not None:
        total = total + torch.where(torch.isfinite(lse), lse, 0.0).mul(grad_lse).sum()
    return total


def _errors(actual: torch.Tensor, truth: torch.Tensor) -> float:
    """Max |actual − truth| with equal infinities exact; NaN or an inf mismatch is infinite."""
    actual, truth = actual.detach().double(), truth.detach().double()
    same_inf = torch.isinf(actual) & torch.isinf(truth) & (actual.sign() == truth.sign())
    diff = torch.where(same_inf, 0.0, (actual - truth).abs())
    return float(torch.nan_to_num(diff, nan=math.inf).max()) if diff.numel() else 0.0


def _run_case(case: dict, rank: int, world: int) -> dict:
    """One case on this rank: assert the shard of out, lse and every gradient."""
    gen = torch.Generator().manual_seed(sum(map(ord, case_name(case))) * 7919 + world)
    dtype, layout = case["dtype"], case["layout"]
    batch, heads, heads_kv, dk = 2, 4, case.get("heads_kv", 2), 8
    dv = case.get("dv", dk)
    tq = 2 * world * CHUNK
    tk = 3 * world * CHUNK if case["mask"] in ("causal_cross", "causal_bottom_right", "alibi&causal") else tq
    q = torch.randn(batch, heads, tq, dk, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, heads_kv, tk, dk, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, heads_kv, tk, dv, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(batch, heads, tq, dv, generator=gen, dtype=torch.float64)
    grad_lse = torch.randn(batch, heads, tq, generator=gen, dtype=torch.float64) if case.get("lse_loss") else None
    modified = case["mask"] in MODIFIED
    params = [torch.rand(heads, generator=gen, dtype=torch.float64) * 0.3,
              torch.randn(heads, 32, generator=gen, dtype=torch.float64)]

    def masked(params_dtype):  # the mask, around learnable copies of the modifiers' tensors
        if not modified:
            return _mask(case["mask"], tq, tk, batch, torch.Generator().manual_seed(tq)), []
        leaves = [p.detach().to(params_dtype, copy=True).requires_grad_() for p in params]
        used = leaves[:1] if case["mask"] == "alibi&causal" else leaves[1:]
        return _modified_mask(case["mask"], tq, leaves), used

    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)  # the inputs; truth is float64 of these
    scale = 1 / math.sqrt(dk)

    whole = [t.detach().double().clone().requires_grad_() for t in (q, k, v)]
    mask, truth_params = masked(torch.float64)
    truth = ak.attention(*whole, mask, backend="reference", return_lse=True)
    _loss(truth.out, truth.lse, grad_out, grad_lse).backward()
    truths = dict(out=truth.out, lse=truth.lse, dq=whole[0].grad, dk=whole[1].grad, dv=whole[2].grad)
    truths.update((f"d{i}", p.grad) for i, p in enumerate(truth_params))
    plains = None
    if dtype != torch.float64:
        plain_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        plain_mask, plain_params = masked(dtype)
        plain_out, plain_lse = _plain_math(*plain_in, plain_mask, scale)
        _loss(plain_out, plain_lse, grad_out.to(dtype), None if grad_lse is None else grad_lse.to(dtype)).backward()
        plains = dict(out=plain_out, lse=plain_lse, dq=plain_in[0].grad, dk=plain_in[1].grad,
                      dv=plain_in[2].grad)
        plains.update((f"d{i}", p.grad) for i, p in enumerate(plain_params))
    mask, ring_params = masked(torch.float32 if dtype != torch.float64 else dtype)

    local = [shard(t, rank, world, layout).requires_grad_() for t in (q, k, v)]
    stats = RingStats()
    if case.get("rank3"):  # [B·H, T/P, D]: one head, leading batch dims only
        flat = [t.flatten(0, 1) for t in local]
        result = ring_attention(*flat, mask, layout=layout,
                                return_lse=True, block_q=BLOCK_Q, block_k=BLOCK_K, stats=stats)
        out, lse = result.out.reshape(batch, heads, -1, dv), result.lse.reshape(batch, heads, -1)
    else:
        result = ring_attention(*local, mask, layout=layout, return_lse=True, block_q=BLOCK_Q,
                                block_k=BLOCK_K, stats=stats, backend=case.get("backend", "tiled"))
        out, lse = result.out, result.lse
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    _loss(out, lse, shard(grad_out, rank, world, layout).to(dtype),
          None if grad_lse is None else shard(grad_lse, rank, world, layout, dim=-1).to(dtype)).backward()
    actuals = dict(out=out, lse=lse, dq=local[0].grad, dk=local[1].grad, dv=local[2].grad)
    for i, p in enumerate(ring_params):  # each rank has its queries' share: summed over the group
        total = p.grad.clone()
        torch.distributed.all_reduce(total)
        actuals[f"d{i}"] = total

    for name, actual in actuals.items():
        dim = -1 if name == "lse" else -2
        whole_tensor = name.startswith("d") and name[1:].isdigit()
        truth_shard = truths[name] if whole_tensor else shard(truths[name], rank, world, layout, dim=dim)
        assert actual.shape == truth_shard.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(truth_shard.shape)}"
        assert not torch.isnan(actual).any(), f"{name} has NaN"
        err = _errors(actual, truth_shard)
        if dtype == torch.float64:
            bound = 1e-9
        else:
            plain = plains[name] if whole_tensor else shard(plains[name], rank, world, layout, dim=dim)
            plain_err = _errors(plain, truth_shard)
            finite = truth_shard.detach()[torch.isfinite(truth_shard)]
            ulps = 8 if dtype == torch.float32 else 1
            floor = ulps * torch.finfo(dtype).eps * max(1.0, float(finite.abs().max()) if finite.numel() else 0.0)
            bound = 2 * plain_err + floor
        assert err <= bound, f"rank {rank}: {name} error {err:.3g} > {bound:.3g}"
    if case["mask"] == "padding":  # batch 0 has no keys: exactly 0 out, −inf lse, 0 grads
        assert (out[0] == 0).all() and torch.isneginf(lse[0]).all() and (local[0].grad[0] == 0).all()
    if case["mask"] == "sinks&padding":  # batch 0: out 0 and the sink's logit as LSE
        assert (out[0] == 0).all() and torch.equal(lse[0], torch.linspace(-1.0, 1.0, 4)[:, None]
                                                    .to(lse.dtype).expand_as(lse[0]))
    if case["mask"] == "none":
        assert stats.pairs_skipped == 0
    return dict(tiles=stats.forward_tiles, backward_tiles=stats.backward_tiles)


# ---- error cases: every rank raises the same error, nobody hangs ------------------------------

def _expect_error(rank, world, make_args, error_type, words) -> float:
    """Call ring_attention with this rank's arguments; assert it raises ``error_type`` whose
    message contains every one of ``words``; return the seconds it took."""
    args, kwargs = make_args(rank)
    start = time.perf_counter()
    try:
        ring_attention(*args, **kwargs)
    except error_type as error:
        message = str(error)
        for word in words:
            assert word in message, f"rank {rank}: {word!r} not in {message!r}"
        return time.perf_counter() - start
    raise AssertionError(f"rank {rank}: no {error_type.__name__} raised")


def _error_cases(rank: int, world: int) -> dict:
    def tensors(t):
        return [torch.randn(1, 2, t, 8) for _ in range(3)]

    def shape_differs(r):  # the last rank's shard is 2 rows longer
        return tensors(16 + (2 if r == world - 1 else 0)), dict(mask=ak.causal())

    def zigzag_odd(r):
        return tensors(15), dict(layout="zigzag")

    def score_function(r):
        return tensors(16), dict(mask=ak.causal() & ak.score_function(lambda s, b, h, i, j: s))

    def wrong_dtype_on_one_rank(r):
        q, k, v = tensors(16)
        return [q, k.long() if r == 0 else k, v], {}

    def local_document_ids(r):  # ids for the shard only, not the whole sequence
        return tensors(16), dict(mask=ak.documents(torch.zeros(16, dtype=torch.long)))

    def bad_layout(r):
        return tensors(16), dict(layout="striped")

    length, last = 16 * world, world - 1

    def document_ids_differ(r):  # one shape, other ids on rank 1
        ids = torch.arange(length) // 4
        return tensors(16), dict(mask=ak.documents(ids if r != 1 else ids.flip(0)) & ak.causal())

    def padding_differs(r):  # 1001 lengths: more than a tensor's repr prints
        lengths = torch.full((1001,), length - 2)
        lengths[500] -= int(r == last)
        return [torch.randn(1001, 1, 16, 8) for _ in range(3)], dict(mask=ak.padding(kv_lengths=lengths))

    def bias_differs(r):  # the bias of rank 0 has one other value
        values = torch.zeros(length, length)
        values[0, 0] = 1.0 if r == 0 else 0.0
        return tensors(16), dict(mask=ak.bias(values))

    def bool_tensor_differs(r):  # a tensor passed as mask= is compared as the mask it becomes
        allowed = torch.ones(length, length, dtype=torch.bool)
        allowed[-1, 0] = r != 1
        return tensors(16), dict(mask=allowed)

    def requires_grad_differs(r):  # only rank 0's q requires grad: only rank 0 would backprop
        q, k, v = tensors(16)
        return [q.requires_grad_(r == 0), k, v], {}

    def bias_requires_grad_differs(r):
        values = torch.zeros(length, length, requires_grad=r == last)
        return tensors(16), dict(mask=ak.bias(values))

    def slopes_requires_grad_differs(r):  # a learnable ALiBi slope on one rank only
        slopes = torch.full((2,), 0.5, requires_grad=r == 0)
        return tensors(16), dict(mask=ak.causal() & ak.alibi(slopes))

    def bad_backward_timeout(r):
        return tensors(16), dict(backward_timeout=0)

    seconds = {}
    if world > 1:
        differing = dict(document_ids=(document_ids_differ, "mask", "rank 1:"),
                         padding=(padding_differs, "mask", f"rank {last}:"),
                         bias=(bias_differs, "mask", "rank 0:"),
                         bool_tensor=(bool_tensor_differs, "mask", "rank 1: dense"),
                         requires_grad=(requires_grad_differs, "requires_grad", "rank 0: q True"),
                         slopes_requires_grad=(slopes_requires_grad_differs, "requires_grad",
                                               "mask tensors [True]"))
        for name, (make_args, key, where) in differing.items():
            seconds[f"{name}_differs"] = _expect_error(rank, world, make_args, ValueError,
                                                       [f"disagree on {key}:", where, "Fix:"])
        with torch.no_grad() if rank == last else contextlib.nullcontext():
            seconds["grad_mode_differs"] = _expect_error(
                rank, world, lambda r: (tensors(16), {}), ValueError,
                ["disagree on grad mode:", f"rank {last}: disabled", "Fix:"])
    # A bias requiring grad (on one rank or all) is refused: the ring gives it no gradient.
    seconds["bias_requires_grad_differs"] = _expect_error(
        rank, world, bias_requires_grad_differs, ValueError,
        [f"rank(s) [{last}]", "no gradient", "detach"])
    seconds["bad_backward_timeout"] = _expect_error(rank, world, bad_backward_timeout, ValueError,
                                                    ["backward_timeout=0"])

    if world > 1:
        seconds["shape_differs"] = _expect_error(rank, world, shape_differs, ValueError,
                                                 ["disagree", f"rank {world - 1}"])
        seconds["wrong_dtype"] = _expect_error(rank, world, wrong_dtype_on_one_rank, TypeError,
                                               ["rank(s) [0]", "dtype"])
        seconds["local_ids"] = _expect_error(rank, world, local_document_ids, ValueError,
                                             ["global positions", str(16 * world)])
    seconds["zigzag_odd"] = _expect_error(rank, world, zigzag_odd, ValueError, ["even"])
    seconds["score_function"] = _expect_error(rank, world, score_function, ValueError,
                                              ["not score_function"])
    seconds["bad_layout"] = _expect_error(rank, world, bad_layout, ValueError, ["striped"])
    # a double backward is refused by the backward itself, on every rank alike
    q, k, v = (t.requires_grad_() for t in tensors(16))
    out = ring_attention(q, k, v, ak.causal())
    try:
        torch.autograd.grad(out.square().sum(), q, create_graph=True)
    except RuntimeError as error:
        assert "no double backward" in str(error), error
    else:
        raise AssertionError(f"rank {rank}: a double backward through the ring ran")
    return seconds


# ---- balance and memory ----------------------------------------------------------------------

BALANCE_T, BALANCE_BLOCK = 1024, 32


def _balance(rank: int, world: int) -> dict:
    """Forward tiles of a causal 1024-long sequence on this rank, per layout."""
    tiles = {}
    for layout in LAYOUTS:
        q = torch.randn(1, 1, BALANCE_T // world, 16)
        stats = RingStats()
        ring_attention(q, q, q, ak.causal(), layout=layout, block_q=BALANCE_BLOCK,
                       block_k=BALANCE_BLOCK, stats=stats)
        tiles[layout] = stats.tiles_per_step
    return tiles


MEMORY_SHAPE = dict(batch=2, heads=32, seq=240, dim=128)  # one whole q/k/v: 7.5 MiB in fp32;
# 240 splits into 2P chunks for every P in 1..4
MEMORY_REPEATS = 2


def _memory(rank: int, world: int) -> dict:
    """Peak RSS growth of causal forward + backward calls, shards created inside the measurement.

    RSS counts the pages really touched (torch's CPU allocations are invisible to tracemalloc);
    ``PeakMemory`` makes glibc return big blocks to the OS on free, so freed memory is not reused
    unseen. What a rank holds is its shards, the K/V in flight, out/lse and the dK/dV sums: all
    ∝ T/P; the tiled engine's own workspace is a few tiles.
    """
    b, h, t, d = MEMORY_SHAPE.values()

    def step():
        q, k, v = (torch.randn(b, h, t // world, d, requires_grad=True) for _ in range(3))
        out = ring_attention(q, k, v, ak.causal(), layout="zigzag")
        out.backward(torch.ones_like(out))

    meter = PeakMemory()  # before any big allocation: see its docstring
    # The first call pages in library code and sets up kernels for these sizes (≈ 35 MB here,
    # whatever P is, belonging to no tensor): measure the later ones, as a training loop sees.
    step()
    peaks = []
    for _ in range(MEMORY_REPEATS):
        with meter:
            step()
        peaks.append(meter.peak)
    return dict(peaks=peaks, shard_bytes=b * h * (t // world) * d * 4)


# ---- the worker -------------------------------------------------------------------------------

def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    results = dict(memory=_memory(rank, world))  # first: before other cases grow the heap
    failures, tiles = {}, {}
    for case in CASES:
        try:
            tiles[case_name(case)] = _run_case(case, rank, world)
            failures[case_name(case)] = None
        except AssertionError as error:
            failures[case_name(case)] = str(error) or "assertion failed"
    results.update(failures=failures, tiles=tiles, errors=_error_cases(rank, world))
    # The group still works after the errors (no rank left behind in a collective).
    results["after_errors"] = _run_case(dict(mask="causal", layout="zigzag", dtype=torch.float64), rank, world)
    if world == 4:
        results["balance"] = _balance(rank, world)
    return results


def _triton_worker(rank: int, world: int) -> dict:
    """The triton cases (``TRITON_INTERPRET=1`` is set before triton is imported here)."""
    torch.set_num_threads(1)
    failures = {}
    for case in TRITON_CASES:
        name = case_name(case)
        if world == 3 and not any(name.startswith(f"{short}-") for short in TRITON_WORLD3):
            continue
        try:
            _run_case(case, rank, world)
            failures[name] = None
        except AssertionError as error:
            failures[name] = str(error) or "assertion failed"
    return failures


_RUNS: dict[int, list[dict]] = {}
_TRITON_RUNS: dict[int, list[dict]] = {}


def run_world(world: int) -> list[dict]:
    """Every rank's results for ``world`` processes (started once per test session)."""
    if world not in _RUNS:
        _RUNS[world] = spawn(_worker, world, threads=1)
    return _RUNS[world]


def run_triton_world(world: int) -> list[dict]:
    """Every rank's failures of the triton cases for ``world`` processes (started once)."""
    if world not in _TRITON_RUNS:
        _TRITON_RUNS[world] = spawn(_triton_worker, world, threads=1, env={"TRITON_INTERPRET": "1"})
    return _TRITON_RUNS[world]


# ---- the tests --------------------------------------------------------------------------------

@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", CASES, ids=case_name)
def test_matches_single_process_reference(world, case):
    """out, lse, dq, dk, dv of every rank's shard == the whole-sequence float64 reference."""
    name = case_name(case)
    problems = [f"rank {rank}: {r['failures'][name]}" for rank, r in enumerate(run_world(world))
                if r["failures"][name]]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.parametrize("case", TRITON_CASES, ids=case_name)
def test_triton_steps_match_single_process_reference(world, case):
    """Steps on the fused triton kernels (the mask's window over each step, LSE out of the
    forward, the global LSE into the backward): out, lse, dq, dk, dv equal the whole-sequence
    float64 reference, as the tiled steps do."""
    pytest.importorskip("triton")
    name = case_name(case)
    runs = run_triton_world(world)
    if name not in runs[0]:
        pytest.skip(f"world 3 runs {TRITON_WORLD3}")
    problems = [f"rank {rank}: {r[name]}" for rank, r in enumerate(runs) if r[name]]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_tiles_cover_the_whole_sequence_once(world):
    """Summed over ranks, the ring computes exactly the tiles one process would (causal:
    the upper triangle is skipped everywhere; no mask: nothing is skipped)."""
    runs = run_world(world)
    # Tiles of the whole (self-attention) sequence: query block i (BLOCK_Q rows) reaches key
    # position BLOCK_Q·(i+1) − 1, i.e. per·(i+1) key blocks with per = BLOCK_Q / BLOCK_K.
    nq, nk = 2 * world * CHUNK // BLOCK_Q, 2 * world * CHUNK // BLOCK_K
    per = BLOCK_Q // BLOCK_K
    for layout in LAYOUTS:
        causal = sum(r["tiles"][f"causal-{layout}-float64"]["tiles"] for r in runs)
        full = sum(r["tiles"][f"none-{layout}-float64"]["tiles"] for r in runs)
        assert full == nq * nk, (layout, full)
        assert causal == per * nq * (nq + 1) // 2, (layout, causal)
        assert all(r["tiles"][f"causal-{layout}-float64"]["backward_tiles"] == r["tiles"][
            f"causal-{layout}-float64"]["tiles"] for r in runs)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_errors_raise_on_every_rank_without_hanging(world):
    """Assertions ran on every rank (a rank that did not raise fails its worker); each error is
    the ValueError or TypeError naming the problem (a rank left waiting would instead end in
    the collective's timeout error), and the group still computed correctly afterwards."""
    for rank, run in enumerate(run_world(world)):
        assert run["errors"], rank
        assert "shape_differs" in run["errors"] or world == 1
        assert run["after_errors"]["tiles"] > 0


DIFFERING = ("document_ids", "padding", "bias", "bool_tensor", "requires_grad",
             "bias_requires_grad", "grad_mode")


@pytest.mark.parametrize("world", WORLD_SIZES[1:])
def test_masks_and_grads_that_differ_across_ranks_raise_on_every_rank(world):
    """Masks of one shape but other contents (document ids, padding lengths, bias values, a bool
    tensor passed as mask=), requires_grad of q/k/v or of a bias, and grad mode that differ on
    one rank raise a ValueError naming what differs and where on every rank (the assertions on
    the message ran in the workers)."""
    for rank, run in enumerate(run_world(world)):
        missing = [name for name in DIFFERING if f"{name}_differs" not in run["errors"]]
        assert not missing, (rank, missing)


def test_zigzag_balances_causal_work():
    """P=4, T=1024, 32×32 tiles: zigzag gives every rank the same causal work (max/min ≤ 1.15);
    contiguous does not (rank 0 only has its diagonal), which shows the count can tell."""
    runs = run_world(4)
    per_rank = {layout: [sum(r["balance"][layout]) for r in runs] for layout in LAYOUTS}
    n = BALANCE_T // BALANCE_BLOCK
    for layout in LAYOUTS:
        assert sum(per_rank[layout]) == n * (n + 1) // 2, (layout, per_rank[layout])
    assert max(per_rank["zigzag"]) / min(per_rank["zigzag"]) <= 1.15, per_rank
    assert max(per_rank["contiguous"]) / min(per_rank["contiguous"]) > 3, per_rank
    # contiguous rank 0 skips every step after its own (keys of later ranks are all in its future)
    assert runs[0]["balance"]["contiguous"][1:] == [0, 0, 0]


def test_peak_memory_falls_as_one_over_world_size():
    """Per-rank peak RSS growth of a forward + backward, measured in every world.

    A rank holds its shards and ring buffers, all ∝ T/P, plus a few engine tiles that do not
    shrink with P, so from P = 2 on P·peak(P) stays nearly level. Measured here: peaks of
    94 / 66 / 49 / 37 MB for P = 1..4 (equal to torch's allocator peak as its profiler counts
    it), so 3·peak(3) and 4·peak(4) are 1.12 × 2·peak(2): peak ≈ a/P + c with c ≈ 7 MB. We
    require ≤ 1.25 (and ≥ 0.8: falling faster than 1/P would mean the measurement missed
    tensors). One process has no ring buffers, so P = 1 sits below the trend: there we ask
    that 4 ranks each hold less than half of it (measured 0.39). Figures are medians over ranks
    and repeats (a rare sample comes out one tensor lower); each sample must cover the three
    input shards.
    """
    peaks = {}
    for world in WORLD_SIZES:
        samples = []
        for r in run_world(world):
            assert min(r["memory"]["peaks"]) >= 3 * r["memory"]["shard_bytes"], (world, r["memory"])
            samples += r["memory"]["peaks"]
        peaks[world] = statistics.median(samples)
    level = {world: peaks[world] * world / (2 * peaks[2]) for world in (3, 4)}
    assert all(0.8 <= x <= 1.25 for x in level.values()), (peaks, level)
    assert peaks[4] < 0.5 * peaks[1], peaks


# ---- sharding helpers (no processes needed) ---------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", (1, 2, 3, 4))
def test_shard_unshard_are_inverses(layout, world):
    x = torch.arange(2 * 3 * 24 * 5, dtype=torch.float64).reshape(2, 3, 24, 5)
    for dim in (-2, 2, 0) if layout == "contiguous" else (-2,):
        size = x.shape[dim]
        if size % (world * (2 if layout == "zigzag" else 1)):
            continue
        parts = [shard(x, rank, world, layout, dim=dim) for rank in range(world)]
        assert torch.equal(unshard(parts, layout, dim=dim), x)
        assert sum(p.shape[dim] for p in parts) == size


def test_zigzag_holds_chunks_r_and_mirror():
    """Hand-checked: 8 positions, P=2 → chunks of 2; rank 0 holds 0,1 + 6,7, rank 1 2,3 + 4,5."""
    x = torch.arange(8)[:, None]
    assert shard(x, 0, 2, "zigzag").flatten().tolist() == [0, 1, 6, 7]
    assert shard(x, 1, 2, "zigzag").flatten().tolist() == [2, 3, 4, 5]
    assert shard(x, 1, 2, "contiguous").flatten().tolist() == [4, 5, 6, 7]


def test_shard_rejects_lengths_the_layout_cannot_split():
    x = torch.zeros(1, 10, 4)
    with pytest.raises(ValueError, match="4 equal chunks"):
        shard(x, 0, 2, "zigzag")
    with pytest.raises(ValueError, match="3 equal chunks"):
        shard(x, 0, 3)
    with pytest.raises(ValueError, match="rank"):
        shard(x, 2, 2)
    with pytest.raises(ValueError, match="layout"):
        shard(x, 0, 2, "striped")
    with pytest.raises(ValueError, match="even"):
        unshard([torch.zeros(3, 4)] * 2, "zigzag")


def test_ring_attention_needs_a_process_group():
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(q, q, q)


# ---- a rank that never comes: a timeout, not a hang --------------------------------------------

def _one_rank_missing(rank: int, world: int) -> None:
    if rank == 1:  # never calls ring_attention; exits once rank 0 has given up
        time.sleep(30)
        return
    q = torch.randn(1, 1, 8, 4)
    ring_attention(q, q, q)  # waits for rank 1 in the shape check until the group timeout


def test_a_missing_rank_times_out_instead_of_hanging():
    """Every wait is bounded by the process group's timeout (here 2 s): the rank left alone
    raises a timeout error, and spawn reports it, instead of waiting for the absent rank."""
    import datetime

    with pytest.raises(Exception, match="(?i)timed out|timeout"):
        spawn(_one_rank_missing, 2, timeout=datetime.timedelta(seconds=2))


# ---- a rank that skips the backward: named within backward_timeout -----------------------------

SKIP_TIMEOUT = 2.0  # seconds; the group's own timeout is spawn's 60 s


def _skips_backward(rank: int, world: int, log_dir: str) -> None:
    """Rank 1 backpropagates a loss that does not use its output, rank 2 never calls backward;
    ranks 0 and 3 run the backward and record the error they get and the seconds it took."""
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    out = ring_attention(q, k, v, ak.causal(), backward_timeout=SKIP_TIMEOUT)
    if rank in (1, 2):
        if rank == 1:
            (q * 2).sum().backward()
        time.sleep(60)  # stopped by spawn once a waiting rank has raised
        return
    start = time.perf_counter()
    try:
        out.sum().backward()
    except RuntimeError as error:
        record = Path(log_dir, f"rank{rank}.txt")
        record.with_suffix(".tmp").write_text(f"{time.perf_counter() - start}\n{error}")
        record.with_suffix(".tmp").rename(record)
        # spawn stops every rank once one raises: the other waiting rank writes its record first
        deadline = time.monotonic() + 10
        while (time.monotonic() < deadline
               and not all(Path(log_dir, f"rank{r}.txt").exists() for r in (0, 3))):
            time.sleep(0.05)
        raise
    raise AssertionError(f"rank {rank}: the backward finished although ranks 1 and 2 skipped it")


def test_a_rank_that_skips_the_backward_is_named_within_the_backward_timeout(tmp_path):
    """4 ranks, 1 and 2 skip the backward: ranks 0 and 3 both raise the backward_timeout's
    error (2 s), naming ranks 1 and 2 and the fix, instead of waiting in the backward's ring
    for the group timeout (60 s), whose error names no rank."""
    with pytest.raises(Exception, match="did not run the backward"):
        spawn(_skips_backward, 4, str(tmp_path))
    for rank in (0, 3):
        _seconds, message = Path(tmp_path, f"rank{rank}.txt").read_text().split("\n", 1)
        assert "ranks 1, 2 did not run the backward of ring_attention" in message, message
        assert "every rank must backpropagate through its output" in message, message
