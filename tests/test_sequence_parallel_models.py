"""Models trained across ranks with sequence parallelism (gloo on CPU, float64).

- ``MultiHeadAttention(sequence_parallel=SequenceParallel(...))`` on 2 and 3 ranks, ring
  (contiguous and zigzag) and Ulysses, causal and packed documents: every rank's output shard,
  its input gradient and the parameter gradients summed over the ranks equal one process's on
  the whole sequence.
- A tiny Llama (``attn_implementation="attnkit"`` inside ``sequence_parallel(sp)``) trained
  for 3 SGD steps on packed documents on 2 ranks, ring and Ulysses: the per-step losses and the
  final weights equal one process's.
- The hybrid (``kind="hybrid"``, a (2, 2) mesh of 4 ranks): the same module cases, the Llama,
  and ``shard``/``positions``/``gather`` of its layout.

Each world size is started once (``spawn``, cached per module) and one worker runs every case
in it; a case's failed check is recorded with its message and raised by the pytest test of
that case. Each rank computes the single-process reference itself (float64, deterministic).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import attnkit as ak
from conftest import spawned_once
from attnkit.distributed.parallel import SequenceParallel
from attnkit.nn import MultiHeadAttention

WORLD_SIZES = (2, 3)
TOL = dict(rtol=1e-9, atol=1e-10)  # float64: the shards' sums differ from one process's by order

# MultiHeadAttention: 6 query heads (a multiple of 2 and 3, for Ulysses), 3 K/V heads (GQA);
# T = 12 splits into 2 and 3 shards and into the 2P chunks of zigzag.
BATCH, SEQ, EMBED, HEADS, KV_HEADS = 2, 12, 24, 6, 3
PARALLEL = {"ring": dict(kind="ring"), "ring-zigzag": dict(kind="ring", layout="zigzag"),
            "ulysses": dict(kind="ulysses")}
MASKS = ("causal", "documents-causal", "documents-key_valid")

# The Llama: packed documents of these lengths in one row of 24 tokens.
DOCUMENTS = (7, 5, 9, 3)
LLAMA_KINDS = ("ring", "ring-zigzag", "ulysses")
STEPS, LR = 3, 0.5


HYBRID_WORLD, HYBRID_MESH = 4, (2, 2)
_MESHES: dict = {}


def mha_cases() -> list[str]:
    return [f"{kind}/{mask}" for kind in PARALLEL for mask in MASKS]


def _parallel(kind: str) -> SequenceParallel:
    """The SequenceParallel of ``kind`` (``"hybrid"``: on this process's (2, 2) mesh, made once)."""
    if kind != "hybrid":
        return SequenceParallel(**PARALLEL[kind])
    if "mesh" not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh
        _MESHES["mesh"] = init_device_mesh("cpu", HYBRID_MESH)
    return SequenceParallel(kind="hybrid", mesh=_MESHES["mesh"])


# ---- MultiHeadAttention ----------------------------------------------------------------------

def _mha_inputs(mask_kind: str):
    """``(x [B, T, E], weights [B, T, E], forward keywords)`` of the whole sequence."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(BATCH, SEQ, EMBED, generator=gen, dtype=torch.float64)
    weights = torch.randn(BATCH, SEQ, EMBED, generator=gen, dtype=torch.float64)
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 3],
                        [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])  # a boundary inside a shard
    if mask_kind == "causal":
        return x, weights, dict(is_causal=True)
    if mask_kind == "documents-causal":
        return x, weights, dict(mask=ak.documents(ids, causal="top_left"))
    real = torch.ones(BATCH, SEQ, dtype=torch.bool)
    real[1, -3:] = False  # padding at the end of row 1: keys on the last rank
    return x, weights, dict(mask=ak.documents(ids), key_valid=real)


def _mha_case(name: str, rank: int, world: int) -> str:
    """'' when the sharded run matches the single-process one, else what differs."""
    import torch.distributed as dist

    kind, mask_kind = name.split("/")
    sp = _parallel(kind)
    torch.manual_seed(0)
    module = MultiHeadAttention(EMBED, HEADS, KV_HEADS, dtype=torch.float64)
    with torch.no_grad():  # nonzero biases: their gradients are checked too
        for p in module.parameters():
            if p.dim() == 1:
                p.normal_()
    x, weights, keywords = _mha_inputs(mask_kind)

    whole = x.clone().requires_grad_()
    out = module(whole, **keywords).out  # [B, T, E]
    (out * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad()

    local = sp.shard(x, dim=1).requires_grad_()  # [B, T/P, E]
    local_out = module(local, sequence_parallel=sp, **keywords).out  # [B, T/P, E]
    (local_out * sp.shard(weights, dim=1)).sum().backward()
    problems = []
    try:
        torch.testing.assert_close(local_out, sp.shard(out.detach(), dim=1), **TOL)
    except AssertionError as error:
        problems.append(f"out: {error}")
    try:
        torch.testing.assert_close(local.grad, sp.shard(whole.grad, dim=1), **TOL)
    except AssertionError as error:
        problems.append(f"input grad: {error}")
    for n, p in module.named_parameters():
        dist.all_reduce(p.grad)  # each rank holds its shard's share
        try:
            torch.testing.assert_close(p.grad, grads[n], **TOL)
        except AssertionError as error:
            problems.append(f"grad {n}: {error}")
    # the comparison can tell: the shard attended alone (positions 0 … T/P - 1) differs
    alone = module(sp.shard(x, dim=1), is_causal=True).out
    if rank and torch.allclose(alone, local_out, rtol=1e-6, atol=1e-6):
        problems.append("the shard attended alone gives the sharded output: the check is blind")
    return "\n".join(problems)


def _mha_refusals(rank: int, world: int) -> dict:
    """What a sequence-parallel MultiHeadAttention refuses on a live group, and
    ``SequenceParallel.positions`` of each layout."""
    failures = {}
    module = MultiHeadAttention(EMBED, HEADS, KV_HEADS, dropout=0.1, dtype=torch.float64)
    x = torch.randn(1, SEQ // world, EMBED, dtype=torch.float64)
    try:
        module.train()(x, is_causal=True, sequence_parallel=SequenceParallel(kind="ring"))
        failures["ring dropout"] = "no error"
    except ValueError as error:
        failures["ring dropout"] = "" if "dropout" in str(error) else str(error)
    try:  # wrong key_valid length: the whole sequence's keys are asked for
        module.eval()(x, key_valid=torch.ones(1, SEQ // world, dtype=torch.bool),
                      sequence_parallel=SequenceParallel(kind="ulysses"))
        failures["local key_valid"] = "no error"
    except ValueError as error:
        failures["local key_valid"] = "" if f"[1, {SEQ}]" in str(error) else str(error)
    for kind in PARALLEL:  # positions() names the global positions shard() cuts
        sp = SequenceParallel(**PARALLEL[kind])
        expected = sp.shard(torch.arange(SEQ), dim=0)
        got = sp.positions(SEQ // world)
        failures[f"{kind} positions"] = "" if torch.equal(got, expected) else f"{got.tolist()}"
    return failures


# ---- the Llama -------------------------------------------------------------------------------

def _llama_batch():
    """``(input_ids [1, T], position_ids [1, T], targets [1, T])`` of the packed row: the
    targets are the next token of the same document, -100 at each document's last token."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 100, (1, sum(DOCUMENTS)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in DOCUMENTS])[None]
    targets = torch.full_like(ids, -100)
    start = 0
    for n in DOCUMENTS:
        targets[0, start:start + n - 1] = ids[0, start + 1:start + n]
        start += n
    return ids, positions, targets


def _llama():
    import transformers

    import attnkit.integrations.transformers as ak_hf

    ak_hf.register()
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=128,
        initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="attnkit")
    return model.to(torch.float64).train()


def _train(model, ids, positions, targets, sp=None) -> list[float]:
    """``STEPS`` SGD steps; the per-step losses (mean over the whole row's targets). With
    ``sp``, each rank feeds its shard and the gradients are summed over the ranks."""
    import torch.distributed as dist

    import attnkit.integrations.transformers as ak_hf

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    count = int((targets != -100).sum())  # the global count of targets
    if sp is not None:
        ids, positions, targets = (sp.shard(t, dim=1) for t in (ids, positions, targets))
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        if sp is None:
            logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        else:
            with ak_hf.sequence_parallel(sp):
                logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        summed = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        (summed / count).backward()
        total = summed.detach().clone()
        if sp is not None:
            dist.all_reduce(total)
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
        losses.append(float(total) / count)
        optimizer.step()
    return losses


def _llama_case(kind: str, rank: int, world: int) -> str:
    import attnkit.integrations.transformers as ak_hf

    ids, positions, targets = _llama_batch()
    reference = _llama()
    losses = _train(reference, ids, positions, targets)
    model = _llama()
    sp = _parallel(kind)
    sharded_losses = _train(model, ids, positions, targets, sp)
    problems = []
    if not all(abs(a - b) <= 1e-10 * max(1.0, abs(b)) for a, b in zip(sharded_losses, losses)):
        problems.append(f"losses {sharded_losses} != single-process {losses}")
    if not losses[-1] < losses[0]:
        problems.append(f"the loss did not fall: {losses}")
    truth = reference.state_dict()
    for n, w in model.state_dict().items():
        try:
            torch.testing.assert_close(w, truth[n], **TOL)
        except AssertionError as error:
            problems.append(f"weight {n}: {error}")
    # the comparison can tell: local position_ids (each shard from 0) change the logits
    with torch.no_grad(), ak_hf.sequence_parallel(sp):
        local_ids = sp.shard(ids, dim=1)
        right = model(input_ids=local_ids, position_ids=sp.shard(positions, dim=1),
                      use_cache=False).logits
        wrong = model(input_ids=local_ids, use_cache=False).logits
    own = sp.shard(positions, dim=1)
    numbered_from_0 = torch.equal(own, torch.arange(own.shape[1])[None])  # nothing to tell
    if torch.allclose(right, wrong, rtol=1e-6, atol=1e-6) and not numbered_from_0:
        problems.append("local position_ids give the same logits: the check is blind")
    # a gap, and a fall short of the least position: transformers' own packed mask (a pass
    # without a cache) starts a document at both, and so does the sharded pass
    half = ids.shape[1] // 2
    for name, row in (("gap", torch.cat([torch.arange(half), torch.arange(40, 40 + half)])),
                      ("fall", torch.cat([torch.arange(half + 2), torch.arange(4, 2 + half)]))):
        row = row[None]
        with torch.no_grad():
            whole = model(input_ids=ids, position_ids=row, use_cache=False).logits
            with ak_hf.sequence_parallel(sp):
                shard = model(input_ids=local_ids, position_ids=sp.shard(row, dim=1),
                              use_cache=False).logits
        try:
            torch.testing.assert_close(shard, sp.shard(whole, dim=1), **TOL)
        except AssertionError as error:
            problems.append(f"{name} positions: {error}")
    return "\n".join(problems)


def _mixed_layers_case(rank: int, world: int) -> str:
    """A Qwen2 whose layer 0 is full attention and layer 1 a sliding window of 4, on the
    ranks with one mask per layer kind: its logits shard equals one process's."""
    import transformers

    import attnkit.integrations.transformers as ak_hf

    ak_hf.register()
    config = transformers.Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, use_sliding_window=True, sliding_window=4,
        max_window_layers=1, initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="attnkit")
    model = model.to(torch.float64).eval()
    ids = torch.randint(3, 100, (1, SEQ), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(SEQ)[None]
    sp = _parallel("ring")
    masks = {"full_attention": None, "sliding_attention": ak.sliding_window(3)}
    with torch.no_grad():
        whole = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        with ak_hf.sequence_parallel(sp, mask=masks):
            shard = model(input_ids=sp.shard(ids, dim=1), position_ids=sp.shard(positions, dim=1),
                          use_cache=False).logits
        with ak_hf.sequence_parallel(sp, mask=ak.sliding_window(3)):  # one mask for both kinds
            try:
                model(input_ids=sp.shard(ids, dim=1), position_ids=sp.shard(positions, dim=1),
                      use_cache=False)
                refused = "one mask for layers of two kinds ran"
            except ValueError as error:
                refused = "" if "layer_types" in str(error) else str(error)
    try:
        torch.testing.assert_close(shard, sp.shard(whole, dim=1), **TOL)
    except AssertionError as error:
        return f"logits: {error}"
    return refused


# ---- the workers -----------------------------------------------------------------------------

def _record(run, *args) -> str:
    try:
        return run(*args)
    except Exception as error:  # noqa: BLE001 - recorded and raised by the case's test
        return f"{type(error).__name__}: {error}"


def _hybrid_worker(rank: int, world: int) -> dict:
    """The hybrid's cases on a (2, 2) mesh: the module, the Llama, and its layout's helpers."""
    result = {"mha": {mask: _record(_mha_case, f"hybrid/{mask}", rank, world) for mask in MASKS}}
    sp = _parallel("hybrid")
    whole = torch.arange(SEQ)
    local = sp.shard(whole, dim=0)
    problems = []
    if not torch.equal(sp.positions(SEQ // world), local):
        problems.append(f"positions {sp.positions(SEQ // world).tolist()} != {local.tolist()}")
    if not torch.equal(sp.gather(local, dim=0), whole):
        problems.append(f"gather gives {sp.gather(local, dim=0).tolist()}")
    if sp.world_size() != world or not 0 <= sp.rank() < world:
        problems.append(f"rank {sp.rank()} of {sp.world_size()}")
    result["layout"] = "\n".join(problems)
    try:
        import transformers  # noqa: F401
    except ImportError:
        result["llama"] = None
    else:
        result["llama"] = _record(_llama_case, "hybrid", rank, world)
    return result


def _worker(rank: int, world: int) -> dict:
    result = {"mha": {name: _record(_mha_case, name, rank, world) for name in mha_cases()},
              "refusals": _mha_refusals(rank, world)}
    if world == 2:
        try:
            import transformers  # noqa: F401
        except ImportError:
            result["llama"] = None
        else:
            result["llama"] = {kind: _record(_llama_case, kind, rank, world)
                               for kind in LLAMA_KINDS}
            result["mixed"] = _record(_mixed_layers_case, rank, world)
    return result


def run_world(world: int) -> list[dict]:
    """Every rank's results for ``world`` processes (started once per test run)."""
    return spawned_once(_worker, world)


def run_hybrid() -> list[dict]:
    """Every rank's results of the hybrid cases (4 processes, started once)."""
    return spawned_once(_hybrid_worker, HYBRID_WORLD)


# ---- the tests -------------------------------------------------------------------------------

@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", mha_cases())
def test_multi_head_attention_matches_one_process(world, case):
    """Output shards, input gradients and summed parameter gradients equal one process's."""
    problems = [f"rank {rank}: {r['mha'][case]}" for rank, r in enumerate(run_world(world))
                if r["mha"][case]]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_refusals_and_positions_on_a_group(world):
    problems = [f"rank {rank} {name}: {failure}" for rank, r in enumerate(run_world(world))
                for name, failure in r["refusals"].items() if failure]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("kind", LLAMA_KINDS)
def test_llama_trained_on_two_ranks_matches_one_process(kind):
    """3 SGD steps on packed documents: per-step losses and final weights as one process's."""
    pytest.importorskip("transformers")
    runs = run_world(2)
    problems = [f"rank {rank}: {r['llama'][kind]}" for rank, r in enumerate(runs)
                if r["llama"][kind]]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("mask", MASKS)
def test_hybrid_multi_head_attention_matches_one_process(mask):
    problems = [f"rank {rank}: {r['mha'][mask]}" for rank, r in enumerate(run_hybrid())
                if r["mha"][mask]]
    assert not problems, "\n".join(problems)


def test_hybrid_layout_shards_positions_and_gathers():
    problems = [f"rank {rank}: {r['layout']}" for rank, r in enumerate(run_hybrid())
                if r["layout"]]
    assert not problems, "\n".join(problems)


def test_llama_trained_on_a_hybrid_mesh_matches_one_process():
    pytest.importorskip("transformers")
    problems = [f"rank {rank}: {r['llama']}" for rank, r in enumerate(run_hybrid())
                if r["llama"]]
    assert not problems, "\n".join(problems)


# ---- refusals that need no group -------------------------------------------------------------

def test_sequence_parallel_validates_its_fields():
    with pytest.raises(ValueError, match="kind="):
        SequenceParallel(kind="tensor")
    with pytest.raises(ValueError, match="contiguous shards only"):
        SequenceParallel(kind="ulysses", layout="zigzag")
    with pytest.raises(ValueError, match="layout="):
        SequenceParallel(layout="striped")
    with pytest.raises(ValueError, match="ring step runs on"):
        SequenceParallel(backend="reference")
    with pytest.raises(TypeError, match="ProcessGroup"):
        SequenceParallel(group=0)
    with pytest.raises(ValueError, match="takes a mesh"):
        SequenceParallel(kind="hybrid")
    with pytest.raises(ValueError, match="takes a mesh"):
        SequenceParallel(kind="ring", mesh=(None, None))
    assert SequenceParallel() == SequenceParallel(kind="ring", layout="contiguous")


@pytest.mark.parametrize("call, words", [
    (lambda m, x, sp: m(x, cache=m.empty_cache(), sequence_parallel=sp), "cache"),
    (lambda m, x, sp: m(x, need_weights=True, sequence_parallel=sp), "weights"),
    (lambda m, x, sp: m(x, lengths=torch.ones(1, dtype=torch.long), sequence_parallel=sp),
     "lengths"),
], ids=["cache", "need_weights", "lengths"])
def test_multi_head_attention_refuses_what_cannot_shard(call, words):
    module = MultiHeadAttention(EMBED, HEADS)
    x = torch.randn(1, 4, EMBED)
    with pytest.raises(ValueError, match=words):
        call(module, x, SequenceParallel())
    module.sequence_parallel = SequenceParallel(kind="ulysses")  # the module's own, too
    with pytest.raises(ValueError, match=words):
        call(module, x, None)
    with pytest.raises(TypeError, match="SequenceParallel"):
        MultiHeadAttention(EMBED, HEADS, sequence_parallel="ring")


def _attention_module(**attributes):
    module = torch.nn.Module()
    module.is_causal = True
    for name, value in attributes.items():
        setattr(module, name, value)
    return module


def test_mixed_layer_kinds_take_one_mask_per_kind():
    """Full and sliding layers under one sequence_parallel block, each with its own mask."""
    pytest.importorskip("transformers")
    problems = [f"rank {rank}: {r['mixed']}" for rank, r in enumerate(run_world(2))
                if r["mixed"]]
    assert not problems, "\n".join(problems)


def test_transformers_sequence_parallel_masks_per_layer_kind():
    """One mask over layers of different kinds is refused (it would be wrong for some); a
    dict must name the layer's kind; a sliding layer's error shows the dict."""
    ak_hf = pytest.importorskip("attnkit.integrations.transformers")
    q = torch.randn(1, 4, 4, 8)
    k = v = torch.randn(1, 2, 4, 8)
    mask = ak_hf.TransformersMask(ak.causal(), 1, 4, 4)
    config = torch.nn.Module()
    config.layer_types = ["full_attention", "sliding_attention"]
    sliding = _attention_module(sliding_window=3, layer_idx=1, config=config)
    keywords = dict(position_ids=torch.arange(4)[None])
    cases = [(ak.sliding_window(2), "layer_types"),
             ({"full_attention": None}, "add the whole sequence's mask for 'sliding_attention'"),
             ({"sliding_attention": None}, "'full_attention': None")]
    for given, words in cases:
        with ak_hf.sequence_parallel(SequenceParallel(), mask=given):
            with pytest.raises(ValueError, match=re.escape(words)):
                ak_hf.attention_forward(sliding, q, k, v, mask, **keywords)
    with pytest.raises(TypeError, match="layer kind"):
        with ak_hf.sequence_parallel(SequenceParallel(), mask={"full_attention": "causal"}):
            pass


@pytest.mark.parametrize("case, words", [
    (dict(output_attentions=True), "output_attentions"),
    (dict(kv_len=6), "use_cache=False"),
    (dict(position_bias=torch.zeros(1, 4, 4, 4)), "position_bias"),
    (dict(cu_seq_lens_q=torch.tensor([0, 4])), "cu_seq_lens"),
    (dict(sliding_window=3), "sliding window"),
    (dict(padded=True), "padding attention_mask"),
    (dict(position_ids=None), "position_ids"),
], ids=["weights", "cache", "position_bias", "cu_seq_lens", "window", "padding", "positions"])
def test_transformers_sequence_parallel_refuses_local_descriptions(case, words):
    ak_hf = pytest.importorskip("attnkit.integrations.transformers")
    case = dict(case)
    kv_len, padded = case.pop("kv_len", 4), case.pop("padded", False)
    keywords = {"position_ids": torch.arange(4)[None], **case}
    q = torch.randn(1, 4, 4, 8)
    k = v = torch.randn(1, 2, kv_len, 8)
    mask = ak_hf.TransformersMask(ak.causal(), 1, 4, kv_len, padded=padded)
    module = _attention_module(sliding_window=keywords.pop("sliding_window", None))
    with ak_hf.sequence_parallel(SequenceParallel()):
        with pytest.raises(ValueError, match=words):
            ak_hf.attention_forward(module, q, k, v, mask, **keywords)
    with pytest.raises(TypeError, match="SequenceParallel"):
        with ak_hf.sequence_parallel("ring"):
            pass


def test_transformers_context_ends_with_its_block():
    """After the block, attention_forward is the single-process one again."""
    ak_hf = pytest.importorskip("attnkit.integrations.transformers")
    q, k, v = torch.randn(3, 1, 2, 5, 8, dtype=torch.float64).unbind(0)
    with ak_hf.sequence_parallel(SequenceParallel()):
        pass
    out, _ = ak_hf.attention_forward(_attention_module(), q, k, v, None)
    torch.testing.assert_close(out, ak.attention(q, k, v, ak.causal()).transpose(1, 2))
