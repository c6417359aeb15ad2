"""``torch.compile(model, fullgraph=True)`` of transformers models on attnkit: one graph, equal
to eager; ``dynamic=True`` over several sequence lengths without a recompile per length.

Graphs are captured with a counting backend that runs the captured graph as is (what
dynamo traces is the question; inductor's code generation is tested in test_compile.py)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnkit.integrations.transformers as ak_hf  # noqa: E402


class Graphs:
    """A ``torch.compile`` backend that counts the graphs dynamo hands it and runs each as is."""

    def __init__(self):
        self.count = 0

    def __call__(self, graph_module, example_inputs):
        self.count += 1
        return graph_module.forward


@pytest.fixture(autouse=True)
def fresh_dynamo():
    ak_hf.register()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=100, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="attnkit").eval()


def _mistral():
    """Sliding window (a mask function that closes over the window): transformers' dense mask
    inside the compiled graph."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        vocab_size=100, max_position_embeddings=64,
                                        sliding_window=4)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="attnkit")
    return model.eval()


def _bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, vocab_size=100)
    return transformers.AutoModel.from_config(config, attn_implementation="attnkit").eval()


def _padded(batch: int, seq: int) -> torch.Tensor:
    """A 0/1 attention mask ``[batch, seq]``, row b left-padded by ``b`` positions."""
    return (torch.arange(seq)[None, :] >= torch.arange(batch)[:, None]).long()


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("make", [_llama, _mistral, _bert], ids=["llama", "mistral", "bert"])
def test_a_model_compiles_to_one_graph_equal_to_eager(make, padded):
    model = make()
    ids = torch.randint(3, 100, (3, 10))
    mask = _padded(3, 10) if padded else torch.ones(3, 10, dtype=torch.long)
    graphs = Graphs()
    compiled = torch.compile(model, fullgraph=True, backend=graphs)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask)[0]
        got = compiled(input_ids=ids, attention_mask=mask)[0]
    assert graphs.count == 1
    real = mask.bool()[..., None]  # padded positions are never seen by real tokens
    torch.testing.assert_close(got.where(real, 0.0), want.where(real, 0.0))


def test_dynamic_shapes_compile_once_for_three_lengths():
    model = _llama()
    graphs = Graphs()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=graphs)
    with torch.no_grad():
        for seq in (9, 13, 21):
            ids = torch.randint(3, 100, (2, seq))
            mask = _padded(2, seq)
            torch.testing.assert_close(compiled(input_ids=ids, attention_mask=mask).logits[1],
                                       model(input_ids=ids, attention_mask=mask).logits[1])
    assert graphs.count == 1


@pytest.mark.parametrize("positions", [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2], list(range(4, 14))],
                         ids=["packed", "unpacked"])
def test_a_row_of_one_compiles_to_one_graph_with_its_position_ids(positions):
    """A batch of one with position_ids: inside the graph no value is read to tell packed
    from unpacked, and either gives what eager gives."""
    model = _llama()
    ids = torch.randint(3, 100, (1, 10))
    position_ids = torch.tensor([positions])
    graphs = Graphs()
    compiled = torch.compile(model, fullgraph=True, backend=graphs)
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=position_ids).logits
        got = compiled(input_ids=ids, position_ids=position_ids).logits
    assert graphs.count == 1
    torch.testing.assert_close(got, want)


def test_packed_boundaries_compile_to_one_graph():
    """``cu_seq_lens_q/k`` (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``):
    checked when the graph runs, not read while tracing; boundaries that disagree raise."""
    model = _llama()
    ids = torch.randint(3, 100, (1, 10))
    packed = dict(position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]]),
                  cu_seq_lens_q=torch.tensor([0, 4, 7, 10], dtype=torch.int32),
                  cu_seq_lens_k=torch.tensor([0, 4, 7, 10], dtype=torch.int32),
                  max_length_q=4, max_length_k=4)
    graphs = Graphs()
    compiled = torch.compile(model, fullgraph=True, backend=graphs)
    with torch.no_grad():
        want = model(input_ids=ids, **packed).logits
        got = compiled(input_ids=ids, **packed).logits
        assert graphs.count == 1
        torch.testing.assert_close(got, want)
        packed["cu_seq_lens_k"] = torch.tensor([0, 5, 7, 10], dtype=torch.int32)
        with pytest.raises(RuntimeError, match="cu_seq_lens_q/k"):
            compiled(input_ids=ids, **packed)


def test_a_layer_compiled_inside_an_eager_model_is_one_graph():
    """transformers' output capture begins outside the compiled layer (the model's forward is
    eager): whether attention weights are recorded is read without a graph break."""
    model = _llama()
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = model(input_ids=ids).logits
        graphs = Graphs()
        layer = model.model.layers[0]
        layer.forward = torch.compile(layer.forward, fullgraph=True, backend=graphs)
        compiled = model(input_ids=ids).logits
    assert graphs.count == 1
    torch.testing.assert_close(compiled, eager)


@pytest.mark.parametrize("name, pattern", [("causal_mask_function", (float("-inf"), 0)),
                                           ("bidirectional_mask_function",
                                            (float("-inf"), float("inf")))])
def test_transformers_own_mask_functions_are_read_while_compiling(name, pattern):
    """Inside a compiled region the causal and bidirectional mask functions are still read
    as structured masks (not the dense fallback): dynamo traces a function's
    ``__qualname__`` unequal to its text, so they are known by identity."""
    from transformers import masking_utils
    found = []

    def read(x, fn):
        found.append(ak_hf._read(fn))
        return x + 1

    torch.compile(read, backend=Graphs(), fullgraph=True)(torch.ones(2),
                                                          getattr(masking_utils, name))
    assert found[0] is not None and (found[0].lo, found[0].hi) == pattern
