"""The triton backend's launch machinery (``attnkit.backends.triton.launch``), through the
Triton interpreter on CPU tensors: plans and their block lists (codes, spacing, the
stored-dS slots, the backward chosen), the mask programs the kernels get (features, documents
as ranges, parts left out of PARTIAL tiles), the layout cache and the launch arguments it
keeps, and compiled launches (the autotuner, its candidates and timings kept on disk, direct
launches after it, pinned candidates: ``TritonOptions.candidate``) checked with stand-ins
for the tuner and the kernel.

Triton is imported in interpreter mode at collection, and each test opts in with
``TRITON_INTERPRET=1``, as in ``tests/test_triton.py`` (see its docstring), which tests the
kernels' numerics; where a test here runs the kernels it checks them the same way
(``conftest.check``: within 2× of plain math's error against float64 math).
"""

from __future__ import annotations

import importlib.util
import inspect
import math
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)


from conftest import import_triton_interpreted, skip_module_unless_interpreted  # noqa: E402

import_triton_interpreted()

import attnkit as ak  # noqa: E402
from attnkit.backends.triton import launch  # noqa: E402
from attnkit.inputs import validate  # noqa: E402
from attnkit.masks import EMPTY, FULL, PARTIAL, MaskSpace  # noqa: E402

from conftest import (check, dense_band, dense_causal, dense_documents, make_qkv,  # noqa: E402
                      walk_options)

skip_module_unless_interpreted(launch, __file__)

SIXTEEN = launch.Tiles(sparse_q=16, sparse_k=16, fwd=(16, 16), dkdv=(16, 16), dq=(16, 16))
"""Sparse blocks of 16 (kernel blocks of 16 divide them)."""



@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """Opt in to the interpreter for this test only (see the module docstring)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# ---- block lists, the stored-dS slots, the backward chosen ---------------------------------------

def test_spacing_of_the_block_lists():
    """``BlockLists.partial_strided``/``full_strided``: the PARTIAL (FULL) entries of every
    row are evenly spaced blocks (any one or two are)."""
    P, F, E = PARTIAL, FULL, EMPTY

    def strided(*rows):
        lists = launch.block_lists(torch.tensor([[rows]], dtype=torch.int8), 1, 1)
        return lists.partial_strided, lists.full_strided
    assert strided([F, F, P, E], [P, F, F, E]) == (True, True)
    assert strided([F, F, P, E], [F, P, F, E]) == (True, True)  # FULL 0, 2: step 2
    assert strided([F, F, P, F]) == (True, False)  # FULL 0, 1, 3
    assert strided([P, P, E, E], [E, E, E, E]) == (True, True)  # no FULL block at all
    assert strided([P, F, F, P, F, P]) == (False, False)  # PARTIAL 0, 3, 5; FULL 1, 2, 4
    assert strided([P, F, P, F, P, E]) == (True, True)  # PARTIAL 0, 2, 4; FULL 1, 3
    assert strided([P, P, F, P], [P, E, E, E]) == (False, True)
    # lengths a multiple of the sparse blocks (a ragged tail block is PARTIAL in every row)
    space = MaskSpace(batch=1, heads=1, q_len=384, kv_len=384, device=torch.device("cpu"))
    for mask in (ak.causal(), ak.sliding_window(200), ak.padding(kv_lengths=[200]),
                 ak.documents(torch.arange(384) // 70) & ak.causal(), None):
        plan = launch.layout(mask, space, launch.GPU_TILES)
        assert plan.rows.full_strided and plan.cols.full_strided, mask
        assert plan.rows.partial_strided and plan.cols.partial_strided, mask


def test_slots_index_the_forward_lists():
    """``Layout.slots``: entry j of key column c (query row r) names the place of c in row r's
    forward list, for masks that differ per batch and head."""
    allowed = torch.rand(2, 3, 90, 90, generator=torch.Generator().manual_seed(1)) < 0.02
    allowed[0, 1] = dense_causal(90, 90)
    space = MaskSpace(batch=2, heads=3, q_len=90, kv_len=90, device=torch.device("cpu"))
    lay = launch.layout(ak.dense(allowed), space, SIXTEEN)
    slots, entries = lay.slots
    rows, cols = lay.rows, lay.cols
    assert entries == int((rows.num_partial + rows.num_full).max())
    checked = 0
    for b in range(2):
        for h in range(3):
            for c in range(cols.index.shape[2]):
                for j in range(int(cols.num_partial[b, h, c] + cols.num_full[b, h, c])):
                    r = int(cols.index[b, h, c, j])
                    e = int(slots[b, h, c, j])
                    assert int(rows.index[b, h, r, e]) == c and e < entries
                    checked += 1
    assert checked == rows.visited()


def test_auto_stores_ds_for_sparse_masks_within_the_budget():
    """``"auto"`` stores dS where no row lists more than half the key blocks and the buffer fits
    ``stored_ds_max_bytes``; a plan keeps the options it was made with."""
    q = torch.zeros(1, 2, 256, 16)

    def planned(mask, **options):
        return launch.make_plan(validate(q, q, q, mask), launch.TritonOptions(**options))
    window, causal = planned(ak.sliding_window(40)), planned(ak.causal())
    assert launch.stores_ds(q, window) and not launch.stores_ds(q, causal)
    assert launch.ds_bytes(q, window) == 2 * (256 // 32) * 3 * 32 * 32 * 4  # 3 blocks a row
    tight = planned(ak.sliding_window(40), stored_ds_max_bytes=launch.ds_bytes(q, window) - 1)
    assert not launch.stores_ds(q, tight)
    assert launch.stores_ds(q, planned(ak.causal(), backward="stored_ds"))
    assert not launch.stores_ds(q, planned(ak.sliding_window(40), backward="recompute"))
    with pytest.raises(ValueError, match="backward='atomic'"):
        launch.TritonOptions(backward="atomic")
    assert window.options.backward == "auto"


# ---- the layout cache (block lists reused between calls) -------------------------------------------

def test_layout_is_reused_for_the_same_mask_and_shapes():
    ids = torch.arange(96) // 32
    mask = ak.documents(ids) & ak.causal()
    first = _plan(mask, 96, 96, launch.INTERPRETER_TILES).layout
    assert _plan(mask, 96, 96, launch.INTERPRETER_TILES).layout is first
    assert _plan(mask, 96, 96, launch.INTERPRETER_TILES, heads=2).layout is not first  # other shapes
    equal = ak.documents(ids.clone()) & ak.causal()  # another tensor: planned again
    assert _plan(equal, 96, 96, launch.INTERPRETER_TILES).layout is not first
    assert ak.masks.cache_key(ak.from_function(lambda b, h, q, kv: q >= kv), []) is None
    big = torch.ones(96, 96, dtype=torch.bool)  # Tq×Tk tensors are never held by a cache
    assert ak.masks.cache_key(ak.dense(big), []) is None
    assert ak.masks.cache_key(ak.bias(big.float()) & ak.causal(), []) is None


def test_layout_cache_sees_in_place_changes(gen):
    """Document ids written in place after a call must give a new layout and right results."""
    ids = torch.arange(64) // 32  # 2 documents
    mask = ak.documents(ids)
    q, k, v = make_qkv(1, 2, 2, 64, 64, 16, 16, torch.float32, gen)
    check(q, k, v, mask, dense_documents(ids), gen=gen, grads=False)
    before = _plan(mask, 64, 64, launch.INTERPRETER_TILES).layout
    ids[:] = torch.arange(64) // 16  # now 4 documents: blocks that were FULL are EMPTY
    assert _plan(mask, 64, 64, launch.INTERPRETER_TILES).layout is not before
    check(q, k, v, mask, dense_documents(ids), gen=gen)


def test_reused_launches_take_the_new_tensors(gen):
    """Launch arguments are built once per layout and shapes; a second call with other tensors
    of the same shapes (and a strided view) must compute with those tensors."""
    mask = ak.sliding_window(9)
    allowed = dense_band(48, 48, 9, 0)
    first = make_qkv(1, 2, 1, 48, 48, 16, 16, torch.float32, gen)
    check(*first, mask, allowed, gen=gen)
    second = make_qkv(1, 2, 1, 48, 48, 16, 16, torch.float32, gen)
    r2, _ = check(*second, mask, allowed, gen=gen)
    wide = torch.randn(1, 2, 48, 32, generator=gen)[..., :16]  # same shape, other strides
    r3, _ = check(wide, *second[1:], mask, allowed, gen=gen)
    assert not torch.equal(r2.out, r3.out)
    layout = _plan(mask, 48, 48, launch.INTERPRETER_TILES, heads=2).layout
    assert layout.calls and not any(isinstance(value, torch.Tensor) and value.shape[-1] == 16
                                    for call in layout.calls.values() for value in call.args.values())


class FakeKernels:
    """Stand-ins for the compiled kernels and the autotuner: each launch is recorded as
    ``(how, grid, arguments)``; ``JITFunction`` returns a binary whose launcher takes every
    parameter in order (as triton's ``CompiledKernel``)."""

    def __init__(self, config):
        self.launches, self.config = [], config
        kernels = self

        class Binary:
            def __getitem__(self, grid):
                return lambda *args: kernels.launches.append(("direct", grid, args))

        class Jit:
            fn = staticmethod(launch.kernels().attn_fwd.fn)  # the kernel's Python function

            def __getitem__(self, grid):
                def run(**kwargs):
                    kernels.launches.append(("jit", grid, kwargs))
                    return Binary()
                return run

        class Tuner:
            best_config = config

            def __getitem__(self, grid):
                return lambda **kwargs: kernels.launches.append(("autotune", grid(config.kwargs), kwargs))

        self.attn_fwd, self.tuner = Jit(), Tuner()


def _fake_compiled(monkeypatch, config=None):
    config = config or SimpleNamespace(kwargs=dict(BLOCK_M=64, BLOCK_N=128, **launch.WALKS["flat+tma"]))
    config.all_kwargs = lambda: dict(config.kwargs, num_warps=8, num_stages=2)
    fake = FakeKernels(config)
    monkeypatch.setattr(launch, "kernels", lambda: fake)
    monkeypatch.setattr(launch, "_tuned", lambda name, cache: fake.tuner)
    monkeypatch.setattr(launch, "_scratch_allocator", lambda: None)
    monkeypatch.setattr(launch, "_LAYOUTS", launch.MaskCache(32))  # no template of another test
    return fake


def test_compiled_launches_autotune_then_jit_then_direct(monkeypatch):
    """Compiled launches of one template: the autotuner first, then ``JITFunction`` with the
    chosen config (whose binary is kept), then that binary directly with every parameter in
    the kernel's order: the same values ``JITFunction`` bound by name, plus the config's
    blocks and walk flags. A tensor's 16-byte alignment or the TMA switch changing, or
    ``direct_launch=False``, sends the launch back through ``JITFunction``. The cache keeps no
    call's tensors alive."""
    fake = _fake_compiled(monkeypatch)
    q = torch.zeros(1, 2, 300, 128)

    def launch_once(q, out=None, **options):
        plan = launch.make_plan(validate(q, q, q, ak.causal()),
                                launch.TritonOptions(tiles=launch.GPU_TILES, **options))
        plan.interpret = False
        out = torch.empty_like(q) if out is None else out
        launch.forward_call(q, q, q, out, torch.empty(1, 2, 300), plan).run(plan)
        return fake.launches[-1]

    assert launch_once(q)[0] == "autotune"
    kind, grid, bound = launch_once(q)
    assert kind == "jit" and grid == (5, 2) and bound["num_warps"] == 8  # 300 rows / 64
    out = torch.empty_like(q)
    kind, grid, positional = launch_once(q, out)
    assert kind == "direct" and grid == (5, 2, 1)
    names = list(inspect.signature(FakeKernels(None).attn_fwd.fn).parameters)
    assert len(positional) == len(names)
    by_name = dict(zip(names, positional))
    for name, value in bound.items():
        if name not in ("num_warps", "num_stages", "Out", "Lse"):  # options; fresh outputs
            assert by_name[name] is value or by_name[name] == value, name
    assert by_name["Q"] is q and by_name["Out"] is out  # this call's tensors, swapped in
    assert by_name["BLOCK_M"] == 64 and by_name["TMA"] is True
    layout = launch.make_plan(validate(q, q, q, ak.causal()),
                              launch.TritonOptions(tiles=launch.GPU_TILES)).layout
    kept = [entry for entry in layout.calls.values() if entry.shared.get("direct")]
    _, values, _ = next(iter(kept[0].shared["direct"].values()))
    assert not any(isinstance(x, torch.Tensor) and x.shape == q.shape for x in values)
    misaligned = torch.zeros(1 * 2 * 300 * 128 + 1)[1:].view(1, 2, 300, 128)  # 4 bytes off
    assert launch_once(misaligned)[0] == "jit"
    assert launch_once(q)[0] == "direct"
    assert launch_once(q, direct_launch=False)[0] == "autotune"  # other options: its own template


@pytest.mark.parametrize("keep", [True, False])
def test_autotune_timings_kept_on_disk(keep, monkeypatch):
    """The tuners are made with ``cache_results`` as the options say (a new process with the
    same shapes and mask kinds reads the timings back instead of timing every candidate
    again), over every candidate of the kernel, pruned to the launch's head-dim bucket."""
    import triton

    made = {}
    real = triton.autotune

    def autotune(**kwargs):
        made.update(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(triton, "autotune", autotune)
    monkeypatch.setattr(launch, "_TUNED", {})
    tuner = launch._tuned("attn_bwd_dq", keep)
    assert made["cache_results"] is keep and tuner is launch._tuned("attn_bwd_dq", keep)
    every = {c for bucket in launch.CONFIGS["attn_bwd_dq"].values() for c in bucket}
    assert len(made["configs"]) == len(every)
    prune = made["prune_configs_by"]["early_config_prune"]
    kept = prune(made["configs"], {}, DK_PAD=128, DV_PAD=64)
    assert len(kept) == len(launch.CONFIGS["attn_bwd_dq"][128])


@pytest.mark.parametrize("with_dlse", [False, True])
def test_dq_writes_the_row_statistics_for_dkdv(with_dlse, gen):
    """The dQ kernel, which runs first in the backward, writes each of its rows' Δ =
    rowsum(dO ∘ O) − dLSE and base-2 LSE (``+inf`` on fully masked rows) for dK/dV; a call
    with the LSE's gradient and one without are different launch templates."""
    q, k, v = make_qkv(1, 2, 2, 70, 50, 32, 32, torch.float32, gen)
    plan = launch.make_plan(validate(q, k, v, ak.padding(q_lengths=[70], kv_lengths=[50])
                                     & ak.causal("bottom_right")))
    out, dout = torch.randn(1, 2, 70, 32, generator=gen), torch.randn(1, 2, 70, 32, generator=gen)
    lse = torch.randn(1, 2, 70, generator=gen)
    lse[:, :, :5] = float("-inf")  # fully masked rows
    dlse = torch.randn(1, 2, 70, generator=gen) if with_dlse else None
    delta, lse2 = torch.full_like(lse, float("nan")), torch.full_like(lse, float("nan"))
    call = launch.dq_call(q, k, v, dout, out, lse, dlse, lse2, delta, torch.empty_like(q), plan)
    assert call.args["HAS_DLSE"] is with_dlse
    call.run(plan)
    expected = (dout * out).sum(-1) - (dlse if with_dlse else 0)
    torch.testing.assert_close(delta, expected, rtol=1e-5, atol=1e-5)
    assert torch.isposinf(lse2[:, :, :5]).all()
    torch.testing.assert_close(lse2[:, :, 5:], lse[:, :, 5:] * math.log2(math.e), rtol=1e-6, atol=0)
    other = launch.dq_call(q, k, v, dout, out, lse, None if with_dlse else lse, lse2, delta,
                           torch.empty_like(q), plan)
    assert other.args["HAS_DLSE"] is not with_dlse


def test_direct_launch_arguments_run_the_kernel(gen):
    """A direct launch's positional arguments (every parameter in order), given to the
    interpreted forward kernel, compute what the keyword launch computes, bit for bit."""
    q, k, v = make_qkv(1, 4, 2, 70, 50, 32, 32, torch.float32, gen)
    plan = launch.make_plan(validate(q, k, v, ak.documents(torch.arange(70) // 30, torch.arange(50) // 20)
                                     & ak.causal("bottom_right")))
    outs = [(torch.empty(1, 4, 70, 32), torch.empty(1, 4, 70)) for _ in range(2)]
    launch.forward_call(q, k, v, *outs[0], plan).run(plan)
    call = launch.forward_call(q, k, v, *outs[1], plan)
    kernel = launch.kernels().attn_fwd
    meta = dict(BLOCK_M=call.fixed[0], BLOCK_N=call.fixed[1], **launch.WALKS["flat"])
    merged = {**call.args, **meta}
    kernel[call.grid(meta)](*[merged[name] for name in launch._arg_names(kernel)])
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("index", [0, 3, 99])
def test_pinned_candidates_skip_the_autotuner(index, monkeypatch):
    """``TritonOptions(candidate=i)`` (checks of every candidate on a GPU): compiled launches run
    candidate i of the head-dim bucket (the last when there are fewer), never the autotuner,
    and record no choice."""
    fake = _fake_compiled(monkeypatch)
    monkeypatch.setattr(launch, "_tuned", lambda *a: pytest.fail("the autotuner must not run"))
    q = torch.zeros(1, 2, 300, 128)
    plan = launch.make_plan(validate(q, q, q, ak.causal()),
                            launch.TritonOptions(tiles=launch.GPU_TILES, candidate=index))
    plan.interpret = False
    call = launch.forward_call(q, q, q, torch.empty_like(q), torch.empty(1, 2, 300), plan)
    call.run(plan)
    candidates = launch.CONFIGS["attn_fwd"][128]
    block_m, block_n, warps, stages, walk = candidates[min(index, len(candidates) - 1)]
    kind, grid, kwargs = fake.launches[0]
    assert kind == "jit" and grid == (-(-300 // block_m), 2)
    assert (kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["num_warps"], kwargs["num_stages"]) == (
        block_m, block_n, warps, stages)
    assert all(kwargs[flag] == value for flag, value in launch.WALKS[walk].items())
    assert call.shared == {}


def test_documents_as_ranges_when_contiguous():
    """Documents that are contiguous runs reach the kernels as ranges (each query's key range,
    each key's query range), others as int32 ids; ids beyond int32 keep their equalities."""
    space = MaskSpace(2, 1, 6, 5)
    q_ids, kv_ids = torch.tensor([7, 7, 2, 2, 2, 9]), torch.tensor([[2, 7, 7, 7, 5], [9, 9, 2, 2, 2]])
    program = launch.compile_mask(ak.documents(q_ids, kv_ids), space)
    assert program.doc_ranges and program.q_docs.dtype == torch.int32
    assert program.q_docs.tolist() == [[[1, 4], [1, 4], [0, 1], [0, 1], [0, 1], [0, 0]],
                                       [[0, 0], [0, 0], [2, 5], [2, 5], [2, 5], [0, 2]]]
    assert program.kv_docs.tolist() == [[[2, 5], [0, 2], [0, 2], [0, 2], [0, 0]],
                                        [[5, 6], [5, 6], [2, 5], [2, 5], [2, 5]]]
    split = launch.compile_mask(ak.documents(torch.tensor([1, 2, 1, 3, 3, 3])), MaskSpace(1, 1, 6, 6))
    assert not split.doc_ranges and split.q_docs.dtype == torch.int32
    huge = torch.tensor([2**40, 2**40, 5, 2**40]).repeat_interleave(2)  # 2**40 in two runs
    wide = launch.compile_mask(ak.documents(huge), MaskSpace(1, 1, 8, 8))
    same = wide.q_docs[0][:, None] == wide.kv_docs[0][None, :]
    assert not wide.doc_ranges and torch.equal(same, huge[:, None] == huge[None, :])

# ---- block skipping (host block lists) -----------------------------------------------------------

@pytest.mark.parametrize("length", [96, 90])
def test_parts_that_forbid_nothing_in_partial_tiles_are_left_out(length, gen):
    """``launch._leaf_needs``: documents aligned to the sparse blocks under causal leave the
    PARTIAL tiles (the diagonal ones, and a ragged tail) to causal alone, with the same
    results; misaligned documents, a bias and a dense part stay in the program; padding that
    covers everything goes."""
    options = walk_options("flat", sparse=32, block=16)
    ids = torch.arange(length) // 32
    aligned = ak.documents(ids) & ak.causal()
    assert _plan(aligned, length, length, launch.INTERPRETER_TILES).program.features() == ["band_hi"]
    q, k, v = make_qkv(1, 2, 1, length, length, 16, 16, torch.float32, gen)
    check(q, k, v, aligned, dense_documents(ids) & dense_causal(length, length), gen=gen,
          options=options)
    misaligned = ak.documents(torch.arange(length) // 40) & ak.causal()
    assert "documents" in _plan(misaligned, length, length, launch.INTERPRETER_TILES).program.features()
    biased = ak.causal() & ak.bias(torch.zeros(length, length)) & ak.padding(kv_lengths=[length])
    assert _plan(biased, length, length, launch.INTERPRETER_TILES).program.features() == ["band_hi", "bias"]
    # only structured parts are weighed (a dense one's block map would evaluate every element)
    dense = ak.causal() & ak.dense(torch.ones(length, length, dtype=torch.bool))
    assert _plan(dense, length, length, launch.INTERPRETER_TILES).program.features() == ["band_hi", "dense"]


def _plan(mask, q_len, kv_len, tiles, heads=1, batch=1):
    q = torch.zeros(batch, heads, q_len, 16)
    k = torch.zeros(batch, heads, kv_len, 16)
    return launch.make_plan(validate(q, k, k, mask), launch.TritonOptions(tiles=tiles))


def test_causal_visits_about_half_the_tiles():
    tiles = SIXTEEN
    n = 1024 // 16
    plan = _plan(ak.causal(), 1024, 1024, tiles)
    assert plan.rows.visited() == n * (n + 1) // 2  # the lower triangle and the diagonal
    assert plan.cols.visited() == n * (n + 1) // 2
    assert int((plan.rows.num_partial).sum()) == n  # only diagonal tiles need the mask
    assert _plan(None, 1024, 1024, tiles).rows.visited() == n * n


def test_window_and_documents_visit_only_their_band():
    tiles = SIXTEEN
    n = 1024 // 16
    window = _plan(ak.sliding_window(32), 1024, 1024, tiles).rows.visited()
    assert window <= 4 * n  # 32 keys back span at most 3 blocks plus the diagonal one
    ids = torch.arange(1024) // 128  # 8 documents of 128: 8×8 blocks each on the diagonal
    docs = _plan(ak.documents(ids), 1024, 1024, tiles)
    assert docs.rows.visited() == 8 * 8 * 8 and int(docs.rows.num_partial.sum()) == 0


def test_block_lists_order_and_tails():
    """PARTIAL blocks are listed first, then FULL; blocks past a ragged end are never FULL."""
    codes = torch.tensor([[[[FULL, EMPTY, PARTIAL, FULL], [EMPTY, EMPTY, EMPTY, EMPTY]]]], dtype=torch.int8)
    lists = launch.block_lists(codes, batch=2, heads=3)
    assert lists.num_partial[1, 2].tolist() == [1, 0] and lists.num_full[0, 0].tolist() == [2, 0]
    assert lists.index[1, 1, 0, :3].tolist() == [2, 0, 3]
    space = validate(torch.zeros(1, 1, 40, 16), torch.zeros(1, 1, 50, 16), torch.zeros(1, 1, 50, 16)).space
    tail = launch.block_codes(None, space, launch.Tiles(sparse_q=32, sparse_k=32))
    assert tail[0, 0].tolist() == [[FULL, PARTIAL], [PARTIAL, PARTIAL]]


def test_mask_program_features():
    """Structured parts of an & chain become index arithmetic; the rest is loaded."""
    space = validate(torch.zeros(2, 2, 40, 16), torch.zeros(2, 2, 40, 16), torch.zeros(2, 2, 40, 16)).space
    program = launch.compile_mask(ak.causal() & ak.sliding_window(8, 3), space)
    assert program.features() == ["band_lo", "band_hi"] and (program.band_lo, program.band_hi) == (-8, 0)
    program = launch.compile_mask(ak.padding(kv_lengths=[3, 9]) & ak.padding(kv_lengths=[5, 4]), space)
    assert program.kv_lengths.tolist() == [3, 4]
    program = launch.compile_mask(ak.documents(torch.arange(40) // 10) | ak.causal(), space)
    assert program.features() == ["dense"] and program.allowed.stride()[:2] == (0, 0)
    program = launch.compile_mask(ak.bias(torch.zeros(40, 40)) & ak.causal("bottom_right"), space)
    assert program.features() == ["band_hi", "bias"]


# ---- host reads ---------------------------------------------------------------------------------

@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("name", ["padding", "left padding", "causal & padding",
                                  "causal(sequences)", "padding(kv_mask)", "documents",
                                  "documents & causal", "documents(causal)"])
def test_a_new_mask_reads_at_most_two_values_and_a_known_one_none(name, invariant):
    """Validating a new mask and laying it out for the kernels (block codes, the lists'
    spacing, the parts PARTIAL tiles need, the mask program: one read) read at most two values
    (each a device sync on CUDA); the same mask again reads none."""
    from attnkit.bench.hostreads import HostReads
    from test_host_reads import _masks, _qkv

    q, k, v = _qkv()

    def call(mask):
        return ak.attention(q, k, v, mask, backend="triton", invariant=invariant)
    call(_masks()[name]())  # the backend's own first-call work
    mask = _masks()[name]()
    with HostReads() as new:
        call(mask)
    with HostReads() as again:
        call(mask)
    assert new.count <= 2 and again.count == 0, (new.by_kind, again.by_kind)


def test_sparse_blocks_that_a_kernel_block_does_not_divide_are_refused():
    """A kernel walks SPARSE // BLOCK kernel blocks per sparse block: 16 over blocks of 32
    would skip every row (LSE −inf), 48 a third of each block."""
    for sparse in (16, 48):
        with pytest.raises(ValueError, match="multiples of each kernel's"):
            launch.Tiles(sparse_q=sparse, sparse_k=sparse)
    with pytest.raises(ValueError, match="multiples of 128"):
        launch.Tiles(sparse_q=64, sparse_k=64).fit_gpu()
    launch.GPU_TILES.fit_gpu()
