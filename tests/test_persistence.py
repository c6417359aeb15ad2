"""Masks, modifiers, modules and caches across pickle, torch.save/load, copy and deepcopy;
state dicts; compiled decoding loops with a KVCache."""

import copy
import io
import pickle

import pytest
import torch
from torch._dynamo.utils import counters

import attnkit as ak
from attnkit.nn import KVCache, MultiHeadAttention, PagedKVCache


def _saved_and_loaded(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


TRIPS = {"pickle": lambda obj: pickle.loads(pickle.dumps(obj)), "torch.save": _saved_and_loaded,
         "deepcopy": copy.deepcopy, "copy": copy.copy}


def causal_rows(b, h, q_idx, kv_idx):  # module level: pickled by name
    return q_idx >= kv_idx


def _masks(gen):
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1]])
    lengths = torch.tensor([3, 6])
    return {
        "causal": ak.causal("bottom_right"),
        "padding": ak.padding(q_lengths=torch.tensor([2, 6]), kv_lengths=lengths),
        "documents": ak.documents(ids, causal="top_left"),
        "sliding_window": ak.sliding_window(2),
        "and": ak.causal() & ak.padding(kv_lengths=lengths),
        "or": ak.sliding_window(1) | ak.documents(ids),
        "not": ~ak.sliding_window(1),
        "per_sequence": ak.causal(sequences=ak.padding(q_lengths=lengths, kv_lengths=lengths)),
        "from_function": ak.from_function(causal_rows),
        "bias": ak.bias(torch.randn(1, 4, 6, 6, generator=gen)),
        "softcap": ak.softcap(5.0) & ak.causal(),
        "alibi": ak.alibi(torch.rand(4, generator=gen)),
        "relative_bias": ak.relative_bias(torch.randn(4, 11, generator=gen).requires_grad_()),
        "sinks": ak.sinks(torch.randn(4, generator=gen)),
    }


@pytest.mark.parametrize("trip", TRIPS)
def test_every_mask_and_modifier_survives_a_round_trip(trip):
    """Each mask kind and modifier gives the same attention after the round trip, and a
    copy derives anew: a write into the copy's tensors changes the copy's results only (no
    memo keyed by the original's tensors is trusted for the copy's)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=gen) for _ in range(3))
    for name, mask in _masks(gen).items():
        want = ak.attention(q, k, v, mask)  # memos filled on the original
        moved = TRIPS[trip](mask)
        torch.testing.assert_close(ak.attention(q, k, v, moved), want, rtol=0, atol=0,
                                   msg=lambda m: f"{name}: {m}")
        if trip in ("pickle", "torch.save", "deepcopy"):
            tensors = ak.masks.held_tensors(moved)
            assert all(all(t is not o for o in ak.masks.held_tensors(mask)) for t in tensors), name
    padded = ak.padding(kv_lengths=torch.tensor([3, 6]))
    want = ak.attention(q, k, v, padded)
    moved = TRIPS[trip](padded)
    ak.attention(q, k, v, moved)
    if trip == "copy":  # a shallow copy shares the tensors: a write shows in both
        return
    with torch.no_grad():
        moved.kv_lengths.fill_(6)
    torch.testing.assert_close(ak.attention(q, k, v, moved), ak.attention(q, k, v))
    torch.testing.assert_close(ak.attention(q, k, v, padded), want, rtol=0, atol=0)


def test_a_lambda_in_from_function_raises_a_pickling_error():
    mask = ak.from_function(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    with pytest.raises((pickle.PicklingError, AttributeError), match="lambda"):
        pickle.dumps(mask)
    assert copy.deepcopy(mask).fn is mask.fn  # copies need no pickling


def _step_lengths(kind):
    return torch.tensor([1, 1]) if kind == "ragged" else None


@pytest.mark.parametrize("trip", ["pickle", "torch.save", "deepcopy"])
@pytest.mark.parametrize("kind", ["grow", "capacity", "window", "ragged", "paged"])
def test_a_module_and_its_cache_mid_generation_survive_a_round_trip(trip, kind):
    """A module with its cache after a prefill, moved together: the copy decodes as the
    original does, and the two never write each other's buffers."""
    gen = torch.Generator().manual_seed(1)
    module = MultiHeadAttention(16, 4, num_kv_heads=2).eval()
    x = torch.randn(2, 8, 16, generator=gen)
    make = {"grow": KVCache.empty, "capacity": lambda: KVCache.empty(capacity=16),
            "window": lambda: KVCache.empty(window=3), "ragged": KVCache.empty,
            "paged": lambda: PagedKVCache(16, 4)}[kind]
    with torch.no_grad():
        _, _, cache = module(x[:, :5], cache=make(), is_causal=True,
                             lengths=torch.tensor([5, 5]) if kind == "ragged" else None)
        moved, moved_cache = TRIPS[trip]((module, cache))
        outs, moved_outs = [], []
        for t in range(5, 8):
            out, _, cache = module(x[:, t:t + 1], cache=cache, is_causal=True,
                                   lengths=_step_lengths(kind))
            moved_out, _, moved_cache = moved(x[:, t:t + 1], cache=moved_cache, is_causal=True,
                                              lengths=_step_lengths(kind))
            outs.append(out)
            moved_outs.append(moved_out)
        torch.testing.assert_close(torch.cat(moved_outs, 1), torch.cat(outs, 1), rtol=0, atol=0)
        if kind != "window":
            torch.testing.assert_close(torch.cat(outs, 1), module(x, is_causal=True).out[:, 5:])
    if kind == "paged":
        assert moved_cache.key_pool.data_ptr() != cache.key_pool.data_ptr()
    else:
        assert moved_cache._store.keys.data_ptr() != cache._store.keys.data_ptr()


def test_a_shallow_copy_of_a_cache_extends_without_changing_the_original():
    """``copy.copy`` of a KVCache shares its buffers; extending both (two branches) leaves
    each one's keys as its own steps made them."""
    gen = torch.Generator().manual_seed(2)
    module = MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 7, 16, generator=gen)
    other = torch.randn(2, 1, 16, generator=gen)
    with torch.no_grad():
        _, _, cache = module(x[:, :6], cache=KVCache.empty(capacity=16), is_causal=True)
        twin = copy.copy(cache)
        _, _, branch = module(other, cache=twin, is_causal=True)
        out, _, _ = module(x[:, 6:], cache=cache, is_causal=True)
        torch.testing.assert_close(out, module(x, is_causal=True).out[:, 6:])
        torch.testing.assert_close(branch.keys[:, :, :6], cache.keys)
    with pytest.raises(TypeError, match="deepcopy"):
        copy.copy(PagedKVCache(4, 4))


def test_state_dict_round_trip_strict_and_into_another_dtype():
    gen = torch.Generator().manual_seed(3)
    source = MultiHeadAttention(16, 4, num_kv_heads=2)
    x = torch.randn(2, 5, 16, generator=gen)
    target = MultiHeadAttention(16, 4, num_kv_heads=2)
    assert not target.load_state_dict(source.state_dict()).missing_keys
    torch.testing.assert_close(target(x).out, source(x).out, rtol=0, atol=0)
    wide = MultiHeadAttention(16, 4, num_kv_heads=2, dtype=torch.float64)
    wide.load_state_dict(source.state_dict())
    assert wide.q_proj.weight.dtype == torch.float64
    torch.testing.assert_close(wide(x.double()).out.float(), source(x).out)
    with pytest.raises(RuntimeError, match="size mismatch"):
        MultiHeadAttention(16, 4).load_state_dict(source.state_dict())  # another num_kv_heads


@pytest.mark.parametrize("kdim", [None, 8])
@pytest.mark.parametrize("strict", [True, False])
def test_a_torch_multihead_attention_state_dict_names_from_torch(kdim, strict):
    """torch's state dict (packed or separate q/k/v weights) is refused with the way to
    convert it, also with strict=False (which would load out_proj alone), under a prefix."""
    torch_module = torch.nn.MultiheadAttention(16, 4, kdim=kdim, vdim=kdim, batch_first=True)
    state = {"attn." + name: value for name, value in torch_module.state_dict().items()}
    layer = torch.nn.Module()
    layer.attn = MultiHeadAttention(16, 4, kdim=kdim, vdim=kdim)
    with pytest.raises(RuntimeError, match=r"from_torch\(src\)") as error:
        layer.load_state_dict(state, strict=strict)
    assert "'attn.in_proj_bias'" in str(error.value)
    converted = MultiHeadAttention.from_torch(torch_module)
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(4))
    kv = x if kdim is None else torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(converted(x, kv, kv).out, torch_module(x, kv, kv)[0])


@pytest.mark.parametrize("prefix", ["", "attn."])
@pytest.mark.parametrize("options", [dict(bias=False), dict(kdim=8, vdim=12),
                                     dict(kdim=8, vdim=8, bias=False)])
def test_the_conversion_a_torch_state_dict_error_names_runs(prefix, options):
    """The code the error gives (torch's module as the state dict needs it, loaded from the
    entries under the prefix, then from_torch) runs and reproduces torch's module."""
    gen = torch.Generator().manual_seed(7)
    torch_module = torch.nn.MultiheadAttention(16, 4, batch_first=True, **options)
    state = {prefix + name: value for name, value in torch_module.state_dict().items()}
    target = MultiHeadAttention(16, 4, kdim=options.get("kdim"), vdim=options.get("vdim"),
                                bias=options.get("bias", True))
    layer = target if not prefix else torch.nn.Module()
    if prefix:
        layer.attn = target
    with pytest.raises(RuntimeError, match=r"from_torch\(src\)") as error:
        layer.load_state_dict(state, strict=False)
    code = str(error.value).split("copy that: ")[1].strip()
    scope = {"torch": torch, "state_dict": state, "MultiHeadAttention": MultiHeadAttention}
    exec(code.replace("MultiHeadAttention.from_torch(src)",
                      "converted = MultiHeadAttention.from_torch(src)"), scope)
    x = torch.randn(2, 3, 16, generator=gen)
    key = torch.randn(2, 3, options.get("kdim", 16), generator=gen)
    value = torch.randn(2, 3, options.get("vdim", 16), generator=gen)
    torch.testing.assert_close(scope["converted"](x, key, value).out,
                               torch_module(x, key, value)[0])


def test_a_torch_state_dict_with_bias_k_is_named_as_such():
    torch_module = torch.nn.MultiheadAttention(16, 4, add_bias_kv=True, batch_first=True)
    with pytest.raises(RuntimeError, match="add_bias_kv=True.*keep torch's module"):
        MultiHeadAttention(16, 4).load_state_dict(torch_module.state_dict(), strict=False)


def _decoder(seed: int, embed: int, heads: int, tokens: int):
    """``(step, x)``: a causal :class:`MultiHeadAttention` decoding step ``step(x, cache) ->
    (out, cache)`` and its inputs ``x [2, tokens, embed]``."""
    gen = torch.Generator().manual_seed(seed)
    module = MultiHeadAttention(embed, heads).eval()
    x = torch.randn(2, tokens, embed, generator=gen)

    def step(x, cache):
        out, _, cache = module(x, is_causal=True, cache=cache)
        return out, cache
    return step, x


def _decode_alike(compiled, step, x, cache, positions, each=lambda cache: None):
    """Extend ``cache`` by the tokens of ``x`` at ``positions``, compiled and eagerly side by
    side, each compiled step equal to the eager one; ``each(cache)`` after every compiled
    step. The compiled chain's last cache."""
    eager = cache
    for t in positions:
        out, cache = compiled(x[:, t:t + 1], cache)
        want, eager = step(x[:, t:t + 1], eager)
        torch.testing.assert_close(out, want, msg=lambda m: f"step {t}: {m}")
        each(cache)
    return cache


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_a_compiled_decoding_loop_has_no_graph_break(context):
    """A ``fullgraph=True`` decoding step over a KVCache, under ``no_grad`` or
    ``inference_mode`` (prefilled eagerly there, so the first compiled step copies the
    inference-mode buffers once): no graph break, no new graph once the steps' shapes are
    dynamic, the steps write one store in place, and each step equals the eager one."""
    step, x = _decoder(6, 32, 4, 16)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    mode = torch.no_grad if context == "no_grad" else torch.inference_mode
    graphs, stores = [], []

    def seen(cache):
        graphs.append(counters["stats"]["unique_graphs"])
        stores.append(cache._store)
    with mode():
        _, cache = step(x[:, :4], KVCache.empty(capacity=32))
        _decode_alike(compiled, step, x, cache, range(4, 16), seen)
    torch._dynamo.reset()
    assert not counters["graph_break"]
    assert graphs[-6:] == [graphs[-1]] * 6, graphs
    assert all(store is stores[-1] for store in stores[-10:])  # written in place


def test_an_inductor_compiled_decoding_loop_with_dynamic_shapes():
    """torch.compile's default backend with dynamic shapes: the steps equal the eager ones,
    the latest cache is extended in place and a sibling from the same cache copies (the
    first keeps its keys)."""
    step, x = _decoder(8, 16, 2, 8)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="inductor", dynamic=True, fullgraph=True)
    with torch.no_grad():
        _, cache = step(x[:, :3], KVCache.empty(capacity=16))
        cache = _decode_alike(compiled, step, x, cache, range(3, 7))
        _, first = compiled(x[:, 7:8], cache)  # the latest cache: written in place
        kept = first.keys.clone()
        _, second = compiled(x[:, 6:7], cache)  # its sibling: copies
        torch.testing.assert_close(first.keys, kept, rtol=0, atol=0)
        assert second._store is not first._store
    torch._dynamo.reset()


@pytest.mark.parametrize("trip", ["deepcopy", "torch.save"])
def test_a_cache_copied_under_inference_mode_is_extended_by_compiled_steps(trip):
    """A cache made under no_grad, copied (or loaded) under inference_mode, holds inference
    tensors: compiled steps outside inference mode copy them once (torch refuses a write
    into them) and equal the eager steps."""
    step, x = _decoder(9, 16, 2, 7)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        _, cache = step(x[:, :3], KVCache.empty(capacity=16))
    with torch.inference_mode():
        cache = TRIPS[trip](cache)
    with torch.no_grad():
        _decode_alike(compiled, step, x, cache, range(3, 7))
    torch._dynamo.reset()
