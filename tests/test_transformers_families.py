"""``attn_implementation="attnkit"`` against ``"eager"`` across transformers' model families.

Each family is a tiny random model (2-3 layers, hidden 64, float32, dropout 0), built twice on
the same weights. Compared on real (non-padded) positions only: hidden states or logits of a
padded batch, the gradients of every parameter in training mode, the attention weights
(``output_attentions=True``), and greedy ``generate`` tokens for decoders and
encoder-decoders. The bound is float32 rounding: ``1e-5`` relative to eager's largest value
(of each output, of each parameter's gradient), ``1e-5`` absolute for weights (≤ 1).
A family this transformers lacks is skipped.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnkit.integrations.transformers as ak_hf  # noqa: E402
from attnkit.masks import MaskSpace  # noqa: E402
from transformers import masking_utils  # noqa: E402

RTOL, WEIGHTS_ATOL = 1e-5, 1e-5
BATCH, SEQ, WINDOW = 3, 12, 5


@pytest.fixture(scope="module", autouse=True)
def registered():
    ak_hf.register()


def _config(name: str, **fields):
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"this transformers has no {name}")
    return cls(**fields)


def _lm(**extra) -> dict:
    # initializer_range 0.2 makes attention far from uniform: a wrong mask changes outputs O(1)
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=100, max_position_embeddings=64,
                initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)


def _encoder(**extra) -> dict:
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=100, max_position_embeddings=64, initializer_range=0.2,
                pad_token_id=0, **extra)


def _vision(**extra) -> dict:
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                image_size=16, patch_size=4, initializer_range=0.2, **extra)


def _seq2seq(**extra) -> dict:
    return dict(d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128, encoder_layers=2,
                decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                vocab_size=100, init_std=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                **extra)


SLIDING_FULL = ["sliding_attention", "full_attention"]

# name -> (config factory, kind); kinds: "decoder", "encoder", "vision", "seq2seq", "speech"
FAMILIES = {
    "gemma3": (lambda: _config("Gemma3TextConfig", **_lm(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        layer_types=SLIDING_FULL)), "decoder"),
    "cohere": (lambda: _config("CohereConfig", **_lm()), "decoder"),
    "cohere2": (lambda: _config("Cohere2Config", **_lm(
        sliding_window=WINDOW, layer_types=SLIDING_FULL)), "decoder"),
    "phi3-window": (lambda: _config("Phi3Config", **_lm(sliding_window=WINDOW)), "decoder"),
    "qwen3-mixed": (lambda: _config("Qwen3Config", **_lm(
        head_dim=16, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
        "decoder"),
    "qwen2-moe": (lambda: _config("Qwen2MoeConfig", **_lm(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32)), "decoder"),
    "qwen3-moe": (lambda: _config("Qwen3MoeConfig", **_lm(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
        "decoder"),
    "gpt-oss": (lambda: _config("GptOssConfig", **_lm(
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        layer_types=SLIDING_FULL)), "decoder"),
    "olmo2": (lambda: _config("Olmo2Config", **_lm()), "decoder"),
    "stablelm": (lambda: _config("StableLmConfig", **_lm()), "decoder"),
    "gpt-neox": (lambda: _config("GPTNeoXConfig", **_lm()), "decoder"),
    "gpt-j": (lambda: _config(
        "GPTJConfig", n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=100,
        n_positions=64, initializer_range=0.2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2), "decoder"),
    "opt": (lambda: _config(
        "OPTConfig", hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=100, max_position_embeddings=64, word_embed_proj_dim=64, init_std=0.2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2), "decoder"),
    "starcoder2-window": (lambda: _config("Starcoder2Config", **_lm(sliding_window=WINDOW)),
                          "decoder"),
    "llama4-chunked": (lambda: _config("Llama4TextConfig", **_lm(
        head_dim=16, attention_chunk_size=4, num_local_experts=2, num_experts_per_tok=1,
        intermediate_size_mlp=128, no_rope_layers=[1, 0], moe_layers=[])), "decoder"),
    "minimax": (lambda: _config("MiniMaxConfig", **_lm(
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, block_size=4,
        layer_types=["linear_attention", "full_attention"])), "decoder"),
    "modernbert-local": (lambda: _config("ModernBertConfig", **_encoder(
        local_attention=6, global_attn_every_n_layers=2)), "encoder"),
    "roberta": (lambda: _config("RobertaConfig", **{**_encoder(), "pad_token_id": 1}),
                "encoder"),
    "distilbert": (lambda: _config(
        "DistilBertConfig", dim=64, hidden_dim=128, n_layers=2, n_heads=4, vocab_size=100,
        max_position_embeddings=64, initializer_range=0.2, pad_token_id=0), "encoder"),
    "clip-text-causal": (lambda: _config("CLIPTextConfig", **{
        **_encoder(bos_token_id=1, eos_token_id=2)}), "encoder"),
    "vit": (lambda: _config("ViTConfig", **_vision()), "vision"),
    "clip-vision": (lambda: _config("CLIPVisionConfig", **_vision()), "vision"),
    "bart": (lambda: _config("BartConfig", **_seq2seq(
        max_position_embeddings=64, decoder_start_token_id=2, forced_eos_token_id=None)),
        "seq2seq"),
    "t5-bias": (lambda: _config(
        "T5Config", d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4, vocab_size=100,
        pad_token_id=0, eos_token_id=2, decoder_start_token_id=0), "seq2seq"),
    "t5gemma": (lambda: _t5gemma(), "seq2seq"),
    "whisper": (lambda: _config("WhisperConfig", **_seq2seq(
        num_mel_bins=16, max_source_positions=8, max_target_positions=64,
        decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None)), "speech"),
}


def _t5gemma():
    module = dict(**_lm(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                        layer_types=SLIDING_FULL))
    encoder = _config("T5GemmaModuleConfig", **module)
    decoder = _config("T5GemmaModuleConfig", **module)
    return _config("T5GemmaConfig", encoder=encoder, decoder=decoder, vocab_size=100,
                   pad_token_id=0, bos_token_id=1, eos_token_id=2)


AUTO = {"decoder": "AutoModelForCausalLM", "encoder": "AutoModel", "vision": "AutoModel",
        "seq2seq": "AutoModelForSeq2SeqLM", "speech": "AutoModelForSpeechSeq2Seq"}


def _no_dropout(config):
    """Every dropout probability of the config (and its sub-configs) set to 0."""
    for field, value in config.to_dict().items():
        if isinstance(value, float) and "drop" in field:
            setattr(config, field, 0.0)
    for sub in ("encoder", "decoder", "text_config", "vision_config"):
        if hasattr(getattr(config, sub, None), "to_dict"):
            _no_dropout(getattr(config, sub))
    return config


def _models(name: str) -> dict:
    """``{"eager": model, "attnkit": model}`` on the same weights, float32, eval mode."""
    factory, kind = FAMILIES[name]
    config = _no_dropout(factory())
    auto = getattr(transformers, AUTO[kind])
    models = {}
    for impl in ("eager", "attnkit"):
        torch.manual_seed(0)  # (from_config draws its weights from the global RNG)
        models[impl] = auto.from_config(copy.deepcopy(config), attn_implementation=impl).eval()
    models["attnkit"].load_state_dict(models["eager"].state_dict())
    return models


def _tokens(padding: str, seq: int = SEQ, seed: int = 1):
    """Token ids and attention_mask [BATCH, seq]: row 0 unpadded, rows 1-2 padded on the given
    side (5 and 2 pad tokens)."""
    ids = torch.randint(3, 100, (BATCH, seq), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(BATCH, seq, dtype=torch.long)
    for row, pads in ((1, 5), (2, 2)):
        if padding == "left":
            mask[row, :pads] = 0
        else:
            mask[row, seq - pads:] = 0
    ids[mask == 0] = 0
    return ids, mask


def _inputs(kind: str, padding: str) -> tuple[dict, torch.Tensor | None]:
    """The model's inputs and the real positions of its output ``[B, T]`` (None: all)."""
    generator = torch.Generator().manual_seed(3)
    if kind == "vision":
        return dict(pixel_values=torch.randn(2, 3, 16, 16, generator=generator)), None
    decoder_ids = torch.randint(3, 100, (BATCH, 6), generator=generator)
    if kind == "speech":  # (audio frames are never padded)
        features = torch.randn(BATCH, 16, 16, generator=generator)
        return dict(input_features=features, decoder_input_ids=decoder_ids), None
    ids, mask = _tokens(padding)
    if kind == "seq2seq":  # the encoder is padded; its real rows are compared below
        return dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids), None
    return dict(input_ids=ids, attention_mask=mask), mask.bool()


def _main(output) -> torch.Tensor:
    logits = getattr(output, "logits", None)
    return output.last_hidden_state if logits is None else logits


def _assert_close(mine: torch.Tensor, eager: torch.Tensor, real, what: str) -> None:
    if real is not None:
        mine, eager = mine[real], eager[real]
    limit = RTOL * eager.abs().max().item()
    assert (mine - eager).abs().max().item() <= limit, what


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_outputs_and_weights_match_eager(name, padding):
    kind = FAMILIES[name][1]
    if kind in ("vision", "speech") and padding == "left":
        pytest.skip("images and audio frames are not padded")
    models = _models(name)
    inputs, real = _inputs(kind, padding)
    with torch.no_grad():
        out = {impl: m(**inputs, output_attentions=True) for impl, m in models.items()}
    _assert_close(_main(out["attnkit"]), _main(out["eager"]), real, "output")
    if kind == "seq2seq":
        _assert_close(out["attnkit"].encoder_last_hidden_state,
                      out["eager"].encoder_last_hidden_state, inputs["attention_mask"].bool(),
                      "encoder output")
    fields = ("attentions", "encoder_attentions", "decoder_attentions", "cross_attentions")
    compared = 0
    for field in fields:
        eager = getattr(out["eager"], field, None)
        if not eager:
            continue
        mine = getattr(out["attnkit"], field)
        assert mine is not None and len(mine) == len(eager), field
        for a, b in zip(mine, eager):
            assert a.shape == b.shape, field
            # [B, Tq] real queries (MiniMax's linear-attention layers record other states)
            rows = (real if real is not None and field == "attentions"
                    and a.shape[2] == real.shape[1] else None)
            diff = (a - b).transpose(1, 2)  # [B, Tq, H, Tk]
            diff = diff if rows is None else diff[rows]
            assert diff.abs().max().item() <= WEIGHTS_ATOL, field
            compared += 1
    assert compared >= 2


def _key_bias(name: str) -> bool:
    """A key projection's bias: softmax ignores what it adds to every score of a query, so its
    gradient is 0 up to rounding, and no relative bound applies to it."""
    return any(part in name for part in ("k_proj.bias", "k_lin.bias", "key.bias"))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_parameter_gradients_match_eager(name):
    models = _models(name)
    kind = FAMILIES[name][1]
    inputs, real = _inputs(kind, "right")
    grads = {}
    for impl, model in models.items():
        model.train()
        output = _main(model(**inputs))
        weights = torch.randn(output.shape, generator=torch.Generator().manual_seed(5))
        if real is not None:  # the loss reads real positions only
            weights = weights * real[..., None]
        (output * weights).sum().backward()
        grads[impl] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads["attnkit"].keys() == grads["eager"].keys()
    for param, eager in grads["eager"].items():
        if not _key_bias(param):
            _assert_close(grads["attnkit"][param], eager, None, param)


@pytest.mark.parametrize("name", [n for n, (_, kind) in FAMILIES.items()
                                  if kind in ("decoder", "seq2seq") and n != "minimax"])
def test_greedy_generate_left_padded_matches_eager(name):
    """8 new tokens after a left-padded 8-token prompt (windows of 5 and chunks of 4 move
    during decoding). MiniMax: see test_a_hybrid_cache_sized_from_a_layer_without_keys_..."""
    models = _models(name)
    ids, mask = _tokens("left", seq=8)
    tokens = {impl: m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                               min_new_tokens=8, do_sample=False)
              for impl, m in models.items()}
    assert torch.equal(tokens["attnkit"], tokens["eager"])


def test_a_hybrid_cache_sized_from_a_layer_without_keys_generates(monkeypatch):
    """MiniMax's cache sizes the decoding mask from its first layer, a linear-attention one
    that keeps no keys: 1 key where the attention layer holds the whole sequence. With a
    left-padded batch the attnkit mask is made again for the layer's keys (the 2-D padding
    mask spans them), giving the tokens of eager sized from the attention layer itself (eager
    as transformers calls it broadcasts the one-key mask over every key)."""
    models = _models("minimax")
    ids, mask = _tokens("left", seq=8)

    def generate(impl):
        return models[impl].generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                                     min_new_tokens=8, do_sample=False)

    as_called = generate("attnkit")
    if not hasattr(masking_utils, "find_first_full_attention_index"):
        pytest.skip("this transformers sizes its masks otherwise")
    monkeypatch.setattr(masking_utils, "find_first_full_attention_index", lambda cache: 1)
    assert torch.equal(as_called, generate("eager"))
    assert torch.equal(as_called, generate("attnkit"))


def test_a_mask_for_keys_the_two_d_mask_does_not_span_is_refused():
    """Made again only where the 2-D padding mask spans the layer's keys: other key counts are
    refused, naming both."""
    q = torch.randn(1, 4, 1, 8, generator=torch.Generator().manual_seed(0))
    k = v = torch.randn(1, 2, 7, 8, generator=torch.Generator().manual_seed(1))
    seen = torch.tensor([[False, True, True, True, True]])  # 5 tokens, the layer has 7 keys
    mask = ak_hf.mask_forward(1, 1, 1, attention_mask=seen)
    with pytest.raises(ValueError, match="1 queries × 1 keys but attends 1 queries × 7 keys"):
        ak_hf.attention_forward(torch.nn.Module(), q, k, v, mask)


@pytest.mark.parametrize("q_len,kv_len,q_offset,kv_offset", [(6, 6, 0, 0), (1, 9, 8, 0),
                                                             (3, 11, 8, 0), (1, 4, 9, 6)])
@pytest.mark.parametrize("padding", ["none", "left"])
def test_a_window_of_no_keys_is_structured(q_len, kv_len, q_offset, kv_offset, padding):
    """Qwen2-MoE makes a sliding mask of window 0 (no key) in every forward pass, for layers
    it has none of: a structured mask of no keys, not transformers' dense ``[B, 1, Tq, Tk]``."""
    seen = q_offset + q_len
    attention_mask = None if padding == "none" else torch.ones(2, seen, dtype=torch.bool)
    if attention_mask is not None:
        attention_mask[1, :2] = False
    args = dict(batch_size=2, q_length=q_len, kv_length=kv_len, q_offset=q_offset,
                kv_offset=kv_offset, attention_mask=attention_mask,
                mask_function=masking_utils.sliding_window_causal_mask_function(0))
    expected = masking_utils.sdpa_mask(**args, allow_is_causal_skip=False)
    result = ak_hf.mask_forward(**args)
    assert result.structured
    got = result.mask.to_dense(MaskSpace(batch=2, heads=1, q_len=q_len, kv_len=kv_len))
    assert torch.equal(got.expand(expected.shape), expected)


def _causal_elsewhere(batch_idx, head_idx, q_idx, kv_idx):  # causal, not transformers' function
    return kv_idx <= q_idx


@pytest.mark.parametrize("where", ["unrecognised function", "compiled region"])
def test_a_dense_fallback_mask_is_made_again_for_the_layers_keys(where):
    """The dense fallback (a mask function attnkit does not read, or any mask made inside a
    compiled region) is made again for a layer that holds the whole sequence, as the
    structured mask is: MiniMax's padded decoding compiled, or with a custom mask function."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 8, generator=generator)
    k, v = torch.randn(2, 2, 2, 7, 8, generator=generator).unbind(0)
    seen = torch.ones(2, 7, dtype=torch.bool)
    seen[1, :3] = False  # left padding; the decoding mask was sized for 1 key
    fn = _causal_elsewhere if where == "unrecognised function" else None
    module = torch.nn.Module()

    def decode(q, k, v):
        mask = ak_hf.mask_forward(2, 1, 1, mask_function=fn, attention_mask=seen)
        return ak_hf.attention_forward(module, q, k, v, mask)[0]

    whole = ak_hf.mask_forward(2, 1, 7, q_offset=6, mask_function=fn, attention_mask=seen)
    expected = ak_hf.attention_forward(module, q, k, v, whole)[0]
    if where == "compiled region":
        torch._dynamo.reset()
        decode = torch.compile(decode, backend="eager", fullgraph=True)
    torch.testing.assert_close(decode(q, k, v), expected, rtol=0, atol=1e-6)
