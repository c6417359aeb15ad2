"""Hybrid sequence parallelism (Ulysses inside a group, ring across groups) with multi-process
gloo on CPU, compared in float64 with single-process ``attention(..., backend="reference")``
on the whole sequence.

Each world size is started once (``spawn``, cached per module) and one worker runs every case
of every mesh of that size; a case's failed assertion is recorded with its message and raised
by the pytest test of that case. H = 6 query heads, so Ulysses sizes 1, 2 and 3 divide it; the
local shards are 4 positions long.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import attnkit as ak
from attnkit.distributed import plan_balance, spawn
from conftest import backward_unless_rank_1, error_failures, expect_error, spawned_once
from attnkit.distributed.hybrid import (hybrid_attention, hybrid_bytes, hybrid_shard,
                                        hybrid_unshard)
from attnkit.distributed.ring import RingStats
from attnkit.distributed.ulysses import ulysses_bytes

HEADS, BATCH, DK, DV, LOCAL = 6, 2, 8, 6, 4
TOL = dict(rtol=1e-9, atol=1e-9)  # float64: partial results differ by rounding only

MESHES = {2: [(1, 2), (2, 1)], 4: [(2, 2)], 6: [(3, 2), (2, 3)]}
"""The meshes (R, U) run in each world size."""

FULL = [dict(mask=m, kv_heads=HEADS) for m in
        ("none", "causal", "window", "documents&causal", "alibi&causal", "bias_per_head&causal",
         "relative&softcap", "sinks&causal")]
FULL += [dict(mask="causal", kv_heads=kv) for kv in (3, 2, 1)]  # GQA (replicated when Hkv ∤ U)
FULL += [dict(mask="documents&causal", kv_heads=2, layout="zigzag"),
         dict(mask="alibi&causal", kv_heads=1, layout="zigzag"),
         dict(mask="documents&causal", kv_heads=3, layout="balanced"),  # plan_balance over R
         dict(mask="window", kv_heads=3, no_lse=True),
         dict(mask="causal", kv_heads=2, pair=True)]  # (ring_group, ulysses_group), no mesh
SHORT = [dict(mask="documents&causal", kv_heads=HEADS), dict(mask="alibi&causal", kv_heads=2),
         dict(mask="causal", kv_heads=1, layout="zigzag")]
CASES = {(1, 2): FULL, (2, 1): FULL, (2, 2): FULL, (3, 2): SHORT, (2, 3): SHORT}
LEARNABLE = {"alibi&causal": "slopes", "relative&softcap": "table", "sinks&causal": "logits"}


def case_name(case: dict) -> str:
    extras = [key for key in ("layout", "no_lse", "pair") if case.get(key)]
    return "-".join([case["mask"], f"hkv{case['kv_heads']}",
                     *(str(case[key]) if key == "layout" else key for key in extras)])


def mesh_name(shape) -> str:
    return f"mesh{shape[0]}x{shape[1]}"


PARAMS = [(world, shape, case) for world, shapes in MESHES.items() for shape in shapes
          for case in CASES[shape]]


# ---- one case on one rank ---------------------------------------------------------------------

def _mask(kind: str, length: int, gen: torch.Generator, params: dict):
    """The mask of the whole sequence; ``params`` holds the learnable tensors it uses."""
    if kind == "none":
        return None
    if kind == "causal":
        return ak.causal()
    if kind == "window":
        return ak.sliding_window(left=3, right=1)
    if kind == "documents&causal":
        ids = torch.randint(0, 4, (length,), generator=gen).sort().values
        return ak.documents(ids) & ak.causal()
    if kind == "alibi&causal":
        return ak.causal() & ak.alibi(params["slopes"])
    if kind == "bias_per_head&causal":
        return ak.bias(torch.randn(1, HEADS, length, length, generator=gen,
                                   dtype=torch.float64)) & ak.causal()
    if kind == "relative&softcap":
        return ak.relative_bias(params["table"]) & ak.softcap(3.0)
    if kind == "sinks&causal":
        return ak.sinks(params["logits"]) & ak.causal()
    raise KeyError(kind)


def _loss(out, lse, grad_out, grad_lse):
    """Σ out·g (+ Σ lse·h): a loss whose gradient reaches every input."""
    total = (out * grad_out).sum()
    if lse is not None:
        total = total + (lse * grad_lse).sum()
    return total


def _run_case(case: dict, shape, mesh, rank: int) -> None:
    """Assert this rank's out, lse, dq, dk, dv (and learnable tensors' gradients, summed over
    the mesh) against the whole-sequence reference."""
    ring, ulysses = shape
    world = ring * ulysses
    coordinate = (rank // ulysses, rank % ulysses)
    seed = sum(map(ord, case_name(case) + mesh_name(shape))) * 7919
    gen = torch.Generator().manual_seed(seed)
    kind, kv_heads, layout = case["mask"], case["kv_heads"], case.get("layout", "contiguous")
    length = LOCAL * world
    q = torch.randn(BATCH, HEADS, length, DK, generator=gen, dtype=torch.float64)
    k = torch.randn(BATCH, kv_heads, length, DK, generator=gen, dtype=torch.float64)
    v = torch.randn(BATCH, kv_heads, length, DV, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(BATCH, HEADS, length, DV, generator=gen, dtype=torch.float64)
    grad_lse = torch.randn(BATCH, HEADS, length, generator=gen, dtype=torch.float64)
    params = dict(slopes=torch.rand(HEADS, generator=gen, dtype=torch.float64),
                  table=torch.randn(HEADS, 32, generator=gen, dtype=torch.float64),
                  logits=torch.randn(HEADS, generator=gen, dtype=torch.float64))
    with_lse = not case.get("no_lse")

    def build():  # the mask around fresh learnable copies of the params
        fresh = {name: p.detach().clone().requires_grad_() for name, p in params.items()}
        return _mask(kind, length, torch.Generator().manual_seed(seed + 1), fresh), fresh

    def cut(x, dim=-2):
        return hybrid_shard(x, coordinate, shape, layout, dim)

    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    mask, truth_params = build()
    if layout == "balanced":  # planned for the R ring ranks over the whole length
        layout = plan_balance(mask, length, ring, tile=2, block=2)
    truth = ak.attention(*whole, mask, backend="reference", return_lse=True)
    _loss(truth.out, truth.lse if with_lse else None, grad_out, grad_lse).backward()

    local = [cut(t).requires_grad_() for t in (q, k, v)]
    mask, ours_params = build()
    where = (mesh.get_group(0), mesh.get_group(1)) if case.get("pair") else mesh
    result = hybrid_attention(*local, mask, mesh=where, return_lse=with_lse, ring_layout=layout)
    if with_lse:
        assert isinstance(result, ak.AttentionResult) and result.weights is None
        out, lse = result.out, result.lse
    else:
        assert isinstance(result, torch.Tensor)
        out, lse = result, None
    _loss(out, lse, cut(grad_out), cut(grad_lse, dim=-1)).backward()
    learned = None
    if kind in LEARNABLE:  # each rank holds its heads' and queries' share: summed over the mesh
        learned = ours_params[LEARNABLE[kind]].grad.clone()
        dist.all_reduce(learned)  # before any assertion, so that every rank joins it

    torch.testing.assert_close(out, cut(truth.out), **TOL, msg=lambda m: f"out: {m}")
    if with_lse:
        torch.testing.assert_close(lse, cut(truth.lse, dim=-1), **TOL, msg=lambda m: f"lse: {m}")
    for name, ours, theirs in zip(("dq", "dk", "dv"), local, whole):
        torch.testing.assert_close(ours.grad, cut(theirs.grad), **TOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
    if learned is not None:
        name = LEARNABLE[kind]
        torch.testing.assert_close(learned, truth_params[name].grad, **TOL,
                                   msg=lambda m: f"d{name}: {m}")


# ---- error cases: every rank raises, nobody hangs ---------------------------------------------

def _error_cases(mesh, flat, rank: int) -> dict:
    def shards(heads=HEADS, length=LOCAL):
        return [torch.randn(1, heads, length, DK, dtype=torch.float64) for _ in range(3)]

    longer = LOCAL + (2 if rank == 3 else 0)
    cases = {
        "heads_not_divisible": (lambda: hybrid_attention(*shards(heads=3), mesh=mesh),
                                ValueError, ["H=3", "(2, 2)", "multiple of"]),
        "mesh_not_2d": (lambda: hybrid_attention(*shards(), mesh=flat), ValueError,
                        ["2-D mesh", "(4,)", "init_device_mesh"]),
        "mesh_not_a_mesh": (lambda: hybrid_attention(*shards(), mesh=4), TypeError,
                            ["DeviceMesh", "int"]),
        "shard_lengths_differ": (lambda: hybrid_attention(*shards(length=longer), mesh=mesh),
                                 ValueError, ["disagree", "shapes", "rank 3", f"{longer}"]),
        "score_function": (lambda: hybrid_attention(
            *shards(), ak.causal() & ak.score_function(lambda s, b, h, i, j: s + h), mesh=mesh),
            ValueError, ["hybrid_attention", "score_function"]),
        "bias_requires_grad": (lambda: hybrid_attention(
            *shards(), ak.bias(torch.zeros(1, HEADS, LOCAL * 4, LOCAL * 4, dtype=torch.float64,
                                           requires_grad=True)), mesh=mesh),
            ValueError, ["constant", "detach"]),
        "local_document_ids": (lambda: hybrid_attention(
            *shards(), ak.documents(torch.zeros(LOCAL, dtype=torch.long)), mesh=mesh),
            ValueError, ["global positions", f"{LOCAL * 4}"]),
    }
    return error_failures(cases)


# ---- bytes sent, counted at the all-to-all and by the ring -----------------------------------

def _measured_bytes(shape, mesh, rank: int) -> dict:
    """Bytes this rank sent (forward, backward) in one call with the LSE: the Ulysses
    all-to-alls counted by wrapping ``all_to_all_single``, the ring's from ``RingStats``."""
    ulysses = shape[1]
    sent = [0]
    original = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        sent[0] += input.numel() * input.element_size() * (ulysses - 1) // ulysses
        return original(output, input, *args, **kwargs)

    gen = torch.Generator().manual_seed(rank)
    q = torch.randn(BATCH, HEADS, LOCAL, DK, generator=gen, dtype=torch.float64,
                    requires_grad=True)
    k = torch.randn(BATCH, 1, LOCAL, DK, generator=gen, dtype=torch.float64,
                    requires_grad=True)
    v = torch.randn(BATCH, 1, LOCAL, DV, generator=gen, dtype=torch.float64,
                    requires_grad=True)
    stats = RingStats()
    dist.all_to_all_single = counting
    try:
        result = hybrid_attention(q, k, v, ak.causal(), mesh=mesh, return_lse=True, stats=stats)
        forward, ring_forward = sent[0], stats.bytes_sent
        _loss(result.out, result.lse, torch.ones_like(result.out),
              torch.ones_like(result.lse)).backward()
    finally:
        dist.all_to_all_single = original
    expected = hybrid_bytes(q.shape, k.shape, v.shape, shape, 8, return_lse=True,
                            lse_element_size=8)
    return dict(forward=forward + ring_forward, backward=sent[0] - forward + stats.bytes_sent
                - ring_forward, expected=dict(forward=expected["forward"],
                                              backward=expected["backward"]))


# ---- the worker -------------------------------------------------------------------------------

def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    results = {}
    for shape in MESHES[world]:
        mesh = init_device_mesh("cpu", shape)
        failures = {}
        for case in CASES[shape]:
            try:
                _run_case(case, shape, mesh, rank)
                failures[case_name(case)] = None
            except AssertionError as error:
                failures[case_name(case)] = str(error) or "assertion failed"
        results[shape] = dict(failures=failures, bytes=_measured_bytes(shape, mesh, rank))
    if world == 2:  # a ring of 2 groups of 1: a chunk of 3 does not cut into 2·2 equal parts
        results["errors"] = {"zigzag_odd_chunk": None}
        try:
            expect_error(lambda: hybrid_attention(
                *(torch.randn(1, HEADS, 3, DK, dtype=torch.float64) for _ in range(3)),
                ak.causal(), mesh=init_device_mesh("cpu", (2, 1)), ring_layout="zigzag"),
                ValueError, ["zigzag", "even", "multiple of 4"])
        except AssertionError as error:
            results["errors"]["zigzag_odd_chunk"] = str(error)
        results["after_errors"] = None
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2))
        results["errors"] = _error_cases(mesh, init_device_mesh("cpu", (4,)), rank)
        after = None  # the group still works after the errors: nobody was left in a transfer
        try:
            _run_case(dict(mask="causal", kv_heads=3), (2, 2), mesh, rank)
        except AssertionError as error:
            after = str(error)
        results["after_errors"] = after
    return results


def run_world(world: int) -> list[dict]:
    """Every rank's results for ``world`` processes (started once per test run)."""
    return spawned_once(_worker, world)


# ---- the tests --------------------------------------------------------------------------------

@pytest.mark.parametrize("world,shape,case", PARAMS,
                         ids=[f"{mesh_name(s)}-{case_name(c)}" for _, s, c in PARAMS])
def test_matches_single_process_attention(world, shape, case):
    """out, lse, dq, dk, dv (and learnable modifier gradients) of every rank's shard equal the
    whole-sequence float64 reference."""
    name = case_name(case)
    problems = [f"rank {rank}: {r[shape]['failures'][name]}"
                for rank, r in enumerate(run_world(world)) if r[shape]["failures"][name]]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world,shape", [(w, s) for w, shapes in MESHES.items() for s in shapes],
                         ids=lambda x: mesh_name(x) if isinstance(x, tuple) else f"world{x}")
def test_bytes_sent_match_hybrid_bytes(world, shape):
    for rank, r in enumerate(run_world(world)):
        measured = r[shape]["bytes"]
        expected = measured["expected"]
        assert measured["forward"] == expected["forward"] > 0, (rank, measured)
        assert measured["backward"] == expected["backward"] > 0, (rank, measured)


@pytest.mark.parametrize("world", [2, 4])
def test_bad_input_raises_on_every_rank(world):
    results = run_world(world)
    problems = [f"rank {rank} {name}: {failure}" for rank, r in enumerate(results)
                for name, failure in r["errors"].items() if failure]
    problems += [f"rank {rank} after errors: {r['after_errors']}"
                 for rank, r in enumerate(results) if r["after_errors"]]
    assert not problems, "\n".join(problems)


def test_hybrid_bytes_degenerate_meshes_are_ulysses_and_ring():
    # B = 2, H = 8, Hkv = 2, T/P = 16, Dk = 32, Dv = 16, fp16, P = 4
    q, k, v = (2, 8, 16, 32), (2, 2, 16, 32), (2, 2, 16, 16)
    as_ulysses = hybrid_bytes(q, k, v, (1, 4), 2)
    assert as_ulysses["ulysses"] == ulysses_bytes(q, k, v, 4, 2)
    assert as_ulysses["ring"]["forward"] == as_ulysses["ring"]["backward"] == 0
    assert as_ulysses["forward"] == ulysses_bytes(q, k, v, 4, 2)["forward"]
    as_ring = hybrid_bytes(q, k, v, (4, 1), 2)
    assert as_ring["ulysses"]["forward"] == as_ring["ulysses"]["backward"] == 0
    kv = 2 * 2 * 16 * (32 + 16)  # elements of one rank's k and v shards
    assert as_ring["forward"] == 3 * kv * 2  # K/V sent P − 1 times
    assert as_ring["backward"] == 3 * kv * 2 + 4 * kv * 4  # and dK/dV (fp32) P times
    mixed = hybrid_bytes(q, k, v, (2, 2), 2)  # 1 K/V head per Ulysses rank, chunks of 32
    assert mixed["ring"]["k"] == 2 * 1 * 32 * 32 * 2
    assert mixed["forward"] == mixed["ulysses"]["forward"] + (2 - 1) * 2 * 1 * 32 * 48 * 2
    with pytest.raises(ValueError, match="H=6.*U=4"):
        hybrid_bytes((1, 6, 4, 8), (1, 6, 4, 8), (1, 6, 4, 8), (1, 4), 2)
    with pytest.raises(ValueError, match="mesh_shape"):
        hybrid_bytes(q, k, v, (4,), 2)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_hybrid_shard_and_unshard_are_inverse(layout):
    x = torch.arange(2 * 24 * 3.0).reshape(2, 24, 3)
    shape = (3, 2)
    shards = [hybrid_shard(x, (r, u), shape, layout) for r in range(3) for u in range(2)]
    assert all(s.shape == (2, 4, 3) for s in shards)
    assert torch.equal(hybrid_unshard(shards, shape, layout), x)
    if layout == "contiguous":  # rank (r, u) holds shard r·U + u of P
        assert torch.equal(shards[3], x[:, 12:16])
    else:  # group 1 holds chunks 1 and 4 of 6, cut in two
        assert torch.equal(shards[2], x[:, 4:8]) and torch.equal(shards[3], x[:, 16:20])
    with pytest.raises(ValueError, match="6 shards|mesh order"):
        hybrid_unshard(shards[:5], shape, layout)


def test_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="process group"):
        hybrid_attention(q, q, q, mesh=None)


# ---- a rank that skips the backward: named within backward_timeout ----------------------------

def _skips_backward(rank: int, world: int, log_dir: str) -> None:
    """A (1, 2) mesh (the Ulysses group's handshake); rank 1 never calls backward."""
    mesh = init_device_mesh("cpu", (1, 2))
    q, k, v = (torch.randn(1, 2, 8, 8, requires_grad=True) for _ in range(3))
    out = hybrid_attention(q, k, v, ak.causal(), mesh=mesh, backward_timeout=2.0)
    backward_unless_rank_1(out, rank, log_dir)
    raise AssertionError("the backward finished although rank 1 skipped it")


def test_a_rank_that_skips_the_backward_is_named_within_the_backward_timeout(tmp_path):
    with pytest.raises(Exception, match="did not run the backward"):
        spawn(_skips_backward, 2, str(tmp_path))
    message = Path(tmp_path, "rank0.txt").read_text()
    assert "hybrid_attention: rank 1 of its all-to-all group did not run the backward" in message
