"""attnkit as a Hugging Face transformers backend (``attn_implementation="attnkit"``).

Tiny models are built from configs with random weights (no downloads); each model is built
three times on the same weights, with ``"eager"`` (the reference), ``"sdpa"`` (the yardstick)
and ``"attnkit"``. Outputs are compared on real (non-padded) tokens only: padded positions
are never seen by real tokens, and eager gives their fully masked rows uniform weights where
attnkit gives 0.

The rule: attnkit differs from eager by at most 2× what sdpa differs from eager, plus a floor
for when sdpa equals eager bit for bit (see :func:`_limit`).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnkit as ak  # noqa: E402
import attnkit.integrations.transformers as ak_hf  # noqa: E402
from attnkit.masks import MaskSpace, key_starts  # noqa: E402
from transformers import masking_utils  # noqa: E402

F32, F64 = torch.float32, torch.float64
BATCH, SEQ, WINDOW = 3, 24, 5

PADDING = type(ak.padding(kv_lengths=[1]))
DENSE = type(ak.dense(torch.ones(1, 1, dtype=torch.bool)))
PADDING = type(ak.padding(kv_lengths=[1]))


@pytest.fixture(scope="module", autouse=True)
def registered():
    ak_hf.register()


def _common(**extra) -> dict:
    # initializer_range 0.2 (not the default 0.02) makes attention far from uniform, so a
    # wrong mask changes the outputs by O(1).
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=100, max_position_embeddings=128,
                initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)


def _decoder_configs() -> dict:
    return {
        "llama-gqa": transformers.LlamaConfig(**_common()),
        "mistral-window": transformers.MistralConfig(sliding_window=WINDOW, **_common()),
        # layer 0 full attention, layer 1 sliding: two masks per forward pass
        "qwen2-mixed": transformers.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW,
                                                max_window_layers=1, **_common()),
    }


def _models(config, auto=transformers.AutoModelForCausalLM, dtype=F32,
            impls=("eager", "sdpa", "attnkit")) -> dict:
    """One model per attention implementation, all with the eager model's weights."""
    models = {}
    for impl in impls:  # a config copy each: from_config sets the implementation on the config
        torch.manual_seed(0)
        model = auto.from_config(copy.deepcopy(config), attn_implementation=impl)
        models[impl] = model.to(dtype).eval()
    weights = models["eager"].state_dict()
    for impl, model in models.items():
        model.load_state_dict(weights)
        assert model.config._attn_implementation == impl
    return models


def _batch(padding: str, seq: int = SEQ, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention_mask [BATCH, seq]: row 0 unpadded, rows 1-2 padded on the
    given side (7 and 3 pad tokens)."""
    ids = torch.randint(3, 100, (BATCH, seq), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(BATCH, seq, dtype=torch.long)
    for row, pads in ((1, 7), (2, 3)):
        if padding == "left":
            mask[row, :pads] = 0
        elif padding == "right":
            mask[row, seq - pads:] = 0
    ids[mask == 0] = 0
    return ids, mask


def _limit(eager: torch.Tensor, sdpa: torch.Tensor, real: torch.Tensor, terms: int) -> float:
    """2× the sdpa−eager difference on real tokens, plus a floor: reordering a float sum of
    ``terms`` values may change it by up to about ``terms · eps · max|value|`` (the classic
    summation bound), which two correct attentions over ``terms`` keys may differ by even
    when sdpa and eager happen to agree exactly."""
    eps = torch.finfo(eager.dtype).eps
    return (2 * (sdpa - eager)[real].abs().max().item()
            + terms * eps * eager[real].abs().max().item())


@pytest.fixture
def captured(monkeypatch) -> list:
    """The masks of the attention calls while the test runs (``ak.attention``, and the runs of
    the plans the integration makes for a forward pass's layers), in call order."""
    masks = []
    real_attention, real_run = ak.attention, ak.Plan._run

    def spy(q, k, v, mask=None, **kwargs):
        masks.append(mask)
        return real_attention(q, k, v, mask, **kwargs)

    def spy_run(plan, q, k, v):
        masks.append(plan.mask)
        return real_run(plan, q, k, v)

    monkeypatch.setattr(ak, "attention", spy)
    monkeypatch.setattr(ak.Plan, "_run", spy_run)
    return masks


def _rand(*shape, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _leaves(mask) -> list:
    parts = getattr(mask, "parts", None)
    return [mask] if not parts else [leaf for part in parts for leaf in _leaves(part)]


# ---- registration --------------------------------------------------------------------------
def test_register_twice_is_harmless():
    ak_hf.register()
    ak_hf.register()
    assert transformers.AttentionInterface()["attnkit"] is ak_hf.attention_forward
    assert masking_utils.AttentionMaskInterface()["attnkit"] is ak_hf.mask_forward
    model = transformers.AutoModel.from_config(transformers.LlamaConfig(**_common()),
                                               attn_implementation="attnkit")
    assert model.config._attn_implementation == "attnkit"


def test_from_pretrained_with_attnkit(tmp_path):
    models = _models(_bert_config(), auto=transformers.AutoModel, impls=("eager", "sdpa"))
    models["eager"].save_pretrained(tmp_path)
    loaded = transformers.AutoModel.from_pretrained(tmp_path, attn_implementation="attnkit").eval()
    assert loaded.config._attn_implementation == "attnkit"
    ids, mask = _batch("right", seq=16)
    with torch.no_grad():
        mine = loaded(input_ids=ids, attention_mask=mask).last_hidden_state
        eager, sdpa = (models[impl](input_ids=ids, attention_mask=mask).last_hidden_state
                       for impl in ("eager", "sdpa"))
    real = mask.bool()
    assert (mine - eager)[real].abs().max().item() <= _limit(eager, sdpa, real, 16)


# ---- decoders: logits against eager ---------------------------------------------------------
@pytest.mark.parametrize("padding", ["none", "right", "left"])
@pytest.mark.parametrize("name", ["llama-gqa", "mistral-window", "qwen2-mixed"])
def test_decoder_logits_match_eager(name, padding):
    models = _models(_decoder_configs()[name])
    ids, mask = _batch(padding)
    with torch.no_grad():
        out = {impl: m(input_ids=ids, attention_mask=mask, output_hidden_states=True)
               for impl, m in models.items()}
    real = mask.bool()
    for field in ("logits", "hidden_states"):
        get = (lambda o: o.logits) if field == "logits" else (lambda o: o.hidden_states[-1])
        eager, sdpa, mine = (get(out[impl]) for impl in ("eager", "sdpa", "attnkit"))
        assert (mine - eager)[real].abs().max().item() <= _limit(eager, sdpa, real, SEQ), field


@pytest.mark.parametrize("padding", ["none", "right", "left"])
@pytest.mark.parametrize("name", ["llama-gqa", "mistral-window"])
def test_float64_decoder_matches_sdpa(name, padding):
    """float64 against sdpa, not eager: eager computes its softmax in float32 whatever the
    model's dtype, and its mask value (float64's lowest) overflows to -inf in float32, so the
    fully masked rows of padding turn NaN there and reach real tokens through their zero
    weights. sdpa computes in float64 throughout: the two agree to float64 rounding."""
    models = _models(_decoder_configs()[name], dtype=F64, impls=("eager", "sdpa", "attnkit"))
    ids, mask = _batch(padding)
    with torch.no_grad():
        out = {impl: m(input_ids=ids, attention_mask=mask).logits for impl, m in models.items()}
    real = mask.bool()
    assert ((out["attnkit"] - out["sdpa"])[real].abs().max().item()
            <= _limit(out["sdpa"], out["sdpa"], real, SEQ))


def test_padding_is_not_lost():
    """The comparison above can fail: without its padding mask the left-padded row changes."""
    models = _models(_decoder_configs()["llama-gqa"], impls=("eager", "attnkit"))
    ids, mask = _batch("left")
    with torch.no_grad():
        padded = models["attnkit"](input_ids=ids, attention_mask=mask).logits
        unmasked = models["attnkit"](input_ids=ids).logits
    assert (padded - unmasked)[1][mask[1].bool()].abs().max() > 1e-2


def test_padded_batch_uses_structured_masks(captured):
    for name in ("llama-gqa", "qwen2-mixed"):
        model = _models(_decoder_configs()[name], impls=("eager", "attnkit"))["attnkit"]
        for padding in ("left", "right"):
            ids, mask = _batch(padding)
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)
    assert len(captured) == 8  # 2 models × 2 paddings × 2 layers
    for mask in captured:
        leaves = _leaves(mask)
        assert any(isinstance(leaf, PADDING) for leaf in leaves), mask
        assert not any(isinstance(leaf, DENSE) for leaf in leaves), mask


def test_packed_sequences_become_documents(captured):
    """position_ids restarting at 0 without a padding mask: each sequence attends only to
    itself, as eager does, through a documents mask."""
    models = _models(_decoder_configs()["llama-gqa"])
    ids, _ = _batch("none")
    ids = ids[:1, :12]
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    with torch.no_grad():
        out = {impl: m(input_ids=ids, position_ids=positions, use_cache=False).logits
               for impl, m in models.items()}
        packed_masks = list(captured)
        alone = models["attnkit"](input_ids=ids[:, 5:8], use_cache=False).logits
    real = torch.ones_like(ids, dtype=torch.bool)
    assert ((out["attnkit"] - out["eager"]).abs().max().item()
            <= _limit(out["eager"], out["sdpa"], real, 12))
    floor = _limit(alone, alone, real[:, :3], 12)
    torch.testing.assert_close(out["attnkit"][:, 5:8], alone, rtol=0, atol=floor)
    documents = type(ak.documents([0]))
    assert len(packed_masks) == 2  # one per layer
    assert all(any(isinstance(leaf, documents) for leaf in _leaves(m)) for m in packed_masks)


# ---- generation with a KV cache --------------------------------------------------------------
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["llama-gqa", "mistral-window", "qwen2-mixed"])
def test_greedy_generate_left_padded_matches_eager(name, cache):
    """20 new tokens after a 10-token left-padded prompt (windows of 5 slide during decoding).
    float32: float64 eager turns left padding into NaN (see the float64 test); on these
    prompts the gap between the two best logits stays far above the attnkit−eager difference,
    so greedy choices are not decided by rounding."""
    models = _models(_decoder_configs()[name], impls=("eager", "attnkit"))
    ids, mask = _batch("left", seq=10)
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    tokens = {impl: m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20,
                               min_new_tokens=20, do_sample=False, **extra)
              for impl, m in models.items()}
    assert tokens["eager"].shape == (BATCH, 30)
    assert torch.equal(tokens["attnkit"], tokens["eager"])


@pytest.mark.parametrize("name", ["llama-gqa", "mistral-window"])
def test_greedy_generate_under_inference_mode_matches_eager(name):
    """Under ``torch.inference_mode`` the model's tensors have no version counter; the mask's
    own tensors, made by the mask function, keep one, and the result is unchanged."""
    models = _models(_decoder_configs()[name], impls=("eager", "attnkit"))
    ids, mask = _batch("left", seq=10)
    with torch.inference_mode():
        tokens = {impl: m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12,
                                   min_new_tokens=12, do_sample=False)
                  for impl, m in models.items()}
    assert tokens["eager"].shape == (BATCH, 22)
    assert torch.equal(tokens["attnkit"], tokens["eager"])


# ---- attention weights ----------------------------------------------------------------------
def test_output_attentions_match_eager():
    models = _models(_decoder_configs()["mistral-window"], impls=("eager", "attnkit"))
    ids, mask = _batch("left")
    with torch.no_grad():
        out = {impl: m(input_ids=ids, attention_mask=mask, output_attentions=True)
               for impl, m in models.items()}
        plain = models["attnkit"](input_ids=ids, attention_mask=mask)
    assert plain.attentions is None
    real = mask.bool()  # [B, Tq]: compare the rows of real queries
    assert len(out["attnkit"].attentions) == 2
    for mine, eager in zip(out["attnkit"].attentions, out["eager"].attentions):
        assert mine.shape == eager.shape == (BATCH, 4, SEQ, SEQ)
        diff = (mine - eager).transpose(1, 2)[real]  # [real queries, H, Tk]
        assert diff.abs().max().item() <= SEQ * torch.finfo(F32).eps


def test_output_attentions_reach_models_that_record_them():
    """GPT-2 takes output_attentions out of its attention calls and records their weights
    through transformers' output capture: attnkit returns them all the same."""
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100,
                                     bos_token_id=1, eos_token_id=2)
    models = _models(config, impls=("eager", "attnkit"))
    ids, mask = _batch("right")
    with torch.no_grad():
        out = {impl: m(input_ids=ids, attention_mask=mask, output_attentions=True)
               for impl, m in models.items()}
        plain = models["attnkit"](input_ids=ids, attention_mask=mask)
    assert not plain.attentions
    real = mask.bool()
    assert len(out["attnkit"].attentions) == 2
    for mine, eager in zip(out["attnkit"].attentions, out["eager"].attentions):
        assert mine.shape == eager.shape == (BATCH, 4, SEQ, SEQ)
        diff = (mine - eager).transpose(1, 2)[real]
        assert diff.abs().max().item() <= SEQ * torch.finfo(F32).eps


# ---- encoders --------------------------------------------------------------------------------
def _bert_config(**extra):
    return transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=128, vocab_size=100,
                                   max_position_embeddings=64, initializer_range=0.2, **extra)


@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_encoder_matches_eager(padding):
    models = _models(_bert_config(), auto=transformers.AutoModel)
    ids, mask = _batch(padding, seq=16)
    with torch.no_grad():
        out = {impl: m(input_ids=ids, attention_mask=mask).last_hidden_state
               for impl, m in models.items()}
    real = mask.bool()
    assert ((out["attnkit"] - out["eager"])[real].abs().max().item()
            <= _limit(out["eager"], out["sdpa"], real, 16))
    weights = mask[..., None].to(F32)
    embedding = {impl: (h * weights).sum(1) / weights.sum(1) for impl, h in out.items()}
    cosine = torch.nn.functional.cosine_similarity(embedding["attnkit"], embedding["eager"])
    assert (cosine >= 0.99999).all()


def test_encoder_attention_dropout_in_training():
    config = _bert_config(attention_probs_dropout_prob=0.5, hidden_dropout_prob=0.0)
    model = transformers.AutoModel.from_config(config, attn_implementation="attnkit")
    ids, mask = _batch("right", seq=16)
    with torch.no_grad():
        model.eval()
        evaluated = model(input_ids=ids, attention_mask=mask).last_hidden_state
        model.train()
        torch.manual_seed(3)
        first = model(input_ids=ids, attention_mask=mask).last_hidden_state
        torch.manual_seed(3)
        again = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(first, again, rtol=0, atol=0)  # seeded: reproducible
    assert (first - evaluated).abs().max() > 1e-3  # the only dropout is on attention weights


# ---- sentence-transformers -------------------------------------------------------------------
SENTENCES = [
    "Hi.",
    "The weather was cold, so we stayed inside and read old books by the fire all afternoon.",
    "Dogs bark.",
    "She opened the door and smiled.",
    "After a long day of work in the busy city, the tired engineer took the last train home "
    "and fell asleep before it reached the quiet station near her small house by the lake.",
    "Why not?",
    "Music makes people happy when they dance together.",
]


def _sentence_encoder_dir(path) -> str:
    """A BERT checkpoint with random weights and a word-level WordPiece vocabulary holding
    every word of SENTENCES, as a sentence-transformers model folder would hold it."""
    words = sorted({w for s in SENTENCES for w in re.findall(r"\w+|[^\w\s]", s.lower())})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    assert len(vocab) <= _bert_config().vocab_size
    tokenizer = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
    torch.manual_seed(0)
    transformers.BertModel(_bert_config()).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_sentence_transformers_embeddings_match_eager(tmp_path, captured, padding_side):
    """Mean-pooled sentence embeddings of one padded batch of real sentences (4 to 38 tokens)
    through sentence-transformers' own ``encode``: attnkit against eager, on a padding mask
    rather than a dense one; right-padded, each sentence as if encoded alone."""
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    path = _sentence_encoder_dir(tmp_path)
    encoders = {}
    for impl in ("eager", "sdpa", "attnkit"):
        transformer = Transformer(path, model_kwargs={"attn_implementation": impl},
                                  processor_kwargs={"padding_side": padding_side})
        pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
        encoders[impl] = st.SentenceTransformer(modules=[transformer, pooling], device="cpu")
        assert transformer.auto_model.config._attn_implementation == impl

    batch = encoders["attnkit"].preprocess(SENTENCES)
    lengths = batch["attention_mask"].sum(1)
    assert (batch["input_ids"] != encoders["attnkit"].tokenizer.unk_token_id).all()
    assert lengths.min() <= 4 and lengths.max() >= 35  # a heavily padded batch
    padded_at = -1 if padding_side == "right" else 0
    assert (batch["attention_mask"][:, padded_at] == 0).sum() == len(SENTENCES) - 1

    captured.clear()
    embeddings = {impl: encoder.encode(SENTENCES, batch_size=len(SENTENCES),
                                       convert_to_tensor=True)
                  for impl, encoder in encoders.items()}
    assert len(captured) == 2  # one batch, two layers
    for mask in captured:
        leaves = _leaves(mask)
        assert any(isinstance(leaf, PADDING) for leaf in leaves), mask
        assert not any(isinstance(leaf, DENSE) for leaf in leaves), mask

    eager, sdpa, mine = (embeddings[impl] for impl in ("eager", "sdpa", "attnkit"))
    cosine = torch.nn.functional.cosine_similarity
    assert (cosine(mine, eager) >= 0.99999).all(), cosine(mine, eager)
    every = torch.ones(len(SENTENCES), dtype=torch.bool)
    assert (mine - eager).abs().max().item() <= _limit(eager, sdpa, every, int(lengths.max()))

    if padding_side == "right":  # positions unchanged by padding: the same as unpadded
        alone = torch.cat([encoders["attnkit"].encode([s], convert_to_tensor=True)
                           for s in SENTENCES])
        assert (cosine(mine, alone) >= 0.99999).all(), cosine(mine, alone)


# ---- score modifiers: softcapping and sinks ----------------------------------------------------
def _against_float64_eager(config, seq: int = 10) -> None:
    """attnkit's logits within 2× float32 eager's error of float64 eager (plus a floor), on
    a padded batch."""
    models = _models(config, impls=("eager", "attnkit"))
    truth = copy.deepcopy(models["eager"]).double()
    ids, mask = _batch("right", seq=seq)
    with torch.no_grad():
        exact = truth(input_ids=ids, attention_mask=mask).logits
        eager, mine = (models[impl](input_ids=ids, attention_mask=mask).logits
                       for impl in ("eager", "attnkit"))
    real = mask.bool()
    bound = (2 * (eager.double() - exact)[real].abs().max().item()
             + 16 * torch.finfo(F32).eps * exact[real].abs().max().item())
    assert (mine.double() - exact)[real].abs().max().item() <= bound


def test_logit_softcapping_runs_as_softcap():
    """Gemma 2's attn_logit_softcapping (small here, so it bends the scores) becomes
    ``ak.softcap``: logits as eager's."""
    config = transformers.Gemma2Config(head_dim=16, attn_logit_softcapping=1.5, sliding_window=64,
                                       **_common())
    _against_float64_eager(config)


def test_attention_sinks_run_as_sinks():
    """gpt-oss's learned sinks (``s_aux=module.sinks``) become ``ak.sinks``: the output and
    the returned weights as gpt-oss's own eager attention gives them (float64 the truth,
    float32 eager the yardstick), under a causal mask with a padded batch row."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = torch.nn.Module().eval()
    module.num_key_value_groups = 2
    module.sinks = torch.nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(3)))
    q, k, v = (_rand(2, heads, 7, 8, seed=seed).to(F32) for heads, seed in ((4, 0), (2, 1), (2, 2)))
    allowed = torch.ones(7, 7, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
    allowed[1, :, :, 5:] = False  # batch row 1: two padded keys
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(F32).min)
    mine, mine_weights = ak_hf.attention_forward(module, q, k, v, allowed, scaling=8 ** -0.5,
                                                 s_aux=module.sinks, output_attentions=True)
    eager = eager_attention_forward(module, q, k, v, additive, scaling=8 ** -0.5)
    module.double()
    exact = eager_attention_forward(module, q.double(), k.double(), v.double(),
                                    additive.double(), scaling=8 ** -0.5)
    for got, plain, truth in zip((mine, mine_weights), eager, exact):
        bound = (2 * (plain.double() - truth).abs().max().item()
                 + 16 * torch.finfo(F32).eps * truth.abs().max().item())
        assert (got.double() - truth).abs().max().item() <= bound
    assert (mine_weights.sum(-1) < 1).all()  # a share of every row went to its sink


def test_sparse_index_selections_raise():
    q = _rand(1, 4, 3, 8)
    with pytest.raises(NotImplementedError, match="selected key indices"):
        ak_hf.attention_forward(torch.nn.Module(), q, q, q, None, indices=torch.zeros(3))


# ---- the attention function called directly --------------------------------------------------
def test_four_d_float_mask_is_added_as_eager_adds_it():
    models = _models(_decoder_configs()["llama-gqa"])
    ids, mask = _batch("right", seq=8)
    allowed = torch.ones(8, 8, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None, :]
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(F32).min)
    with torch.no_grad():
        out = {impl: m(input_ids=ids, attention_mask=additive).logits for impl, m in models.items()}
    real = mask.bool()
    assert (out["attnkit"] - out["eager"])[real].abs().max().item() <= _limit(
        out["eager"], out["sdpa"], real, 8)


def test_cu_seq_lens_keep_packed_sequences_apart():
    q, k, v = _rand(3, 1, 4, 9, 8).unbind(0)  # [B, H, T, D] each
    module = torch.nn.Module()
    module.is_causal = True
    cu = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    out, weights = ak_hf.attention_forward(module, q, k, v, None, cu_seq_lens_q=cu,
                                           cu_seq_lens_k=cu)
    assert weights is None and out.shape == (1, 9, 4, 8)  # [B, T, H, D]
    for start, stop in ((0, 3), (3, 5), (5, 9)):
        part = slice(start, stop)
        alone = ak.attention(q[:, :, part], k[:, :, part], v[:, :, part], ak.causal())
        torch.testing.assert_close(out[:, part], alone.transpose(1, 2))


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_flattened_batch_in_training_equals_each_document_alone(flash_kwargs):
    """transformers' DataCollatorWithFlattening packs documents into one row; in train mode
    with the default use_cache, transformers builds a plain causal mask (it looks for packed
    sequences only without a cache), so the packing reaches attnkit only as position_ids or
    cu_seq_lens_q/k: each document must still attend only to itself, in logits and in
    gradients."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(  # float64: sums differ in order only
        transformers.LlamaConfig(**_common()), attn_implementation="attnkit").to(F64).train()
    documents = [[5, 6, 7, 9, 11, 3], [8, 9, 10], [3, 4, 12, 13, 14]]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(
        [{"input_ids": d} for d in documents])
    weights = _rand(sum(map(len, documents)), 100, seed=3)  # a loss that reads every logit

    def gradients(loss):
        model.zero_grad()
        loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()
                if p.grad is not None}

    packed = model(**batch).logits[0]  # [T, V]
    packed_grads = gradients((packed * weights).sum())
    alone = torch.cat([model(input_ids=torch.tensor([d])).logits[0] for d in documents])
    alone_grads = gradients((alone * weights).sum())
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-10)
    assert packed_grads.keys() == alone_grads.keys()
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, alone_grads[name], rtol=1e-9, atol=1e-9, msg=name)


def test_unpacked_position_ids_leave_the_mask_alone(captured):
    """A batch of one whose position_ids run on by one (generation, an unpacked row) gets no
    documents mask: the causal mask transformers asked for, unchanged."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**_common()), attn_implementation="attnkit").eval()
    ids, _ = _batch("none")
    with torch.no_grad():
        model(input_ids=ids[:1], position_ids=torch.arange(3, 3 + SEQ)[None])
    documents = type(ak.documents([0]))
    assert captured and not any(isinstance(leaf, documents)
                                for mask in captured for leaf in _leaves(mask))


def test_a_gap_in_a_single_rows_position_ids_does_not_split_it():
    """Positions that jump without restarting (``[0..11, 40..51]``) are one sequence, as
    ``flash_attention_2`` reads them (a sequence starts only where the positions come back to
    their least value) and as sdpa and eager compute: the row alone equals the row in a
    batch of two, which is never read as packed."""
    models = _models(transformers.LlamaConfig(**_common()), dtype=F64)
    ids, _ = _batch("none")
    positions = torch.cat([torch.arange(SEQ // 2), torch.arange(40, 40 + SEQ // 2)])[None]
    with torch.no_grad():
        logits = {impl: m(input_ids=ids[:1], position_ids=positions).logits
                  for impl, m in models.items()}
        pair = models["attnkit"](input_ids=ids[:1].repeat(2, 1),
                                 position_ids=positions.repeat(2, 1)).logits
    real = torch.ones(1, SEQ, dtype=torch.bool)
    limit = _limit(logits["eager"], logits["sdpa"], real, SEQ)
    assert (logits["attnkit"] - logits["eager"]).abs().max() <= limit
    torch.testing.assert_close(logits["attnkit"][0], pair[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("positions", [
    [0, 1, 2, 3, 0, 1, 2, 0, 1], [0, 1, 2, 10, 11, 12, 0, 1], [2, 3, 4, 2, 3, 2],
    [0, 1, 2, 3, 1, 2, 3, 0, 1], [5, 6, 7, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
def test_packed_rows_are_read_as_transformers_reads_them(positions):
    """Where transformers built no packed mask (a pass with a cache), a row's documents start
    where ``flash_attention_2`` starts them: where the positions come back to their least
    value. Under sequence parallelism (a pass without a cache), where transformers' own
    ``find_packed_sequence_indices`` starts them: wherever they do not run on by one."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    row = torch.tensor([positions])

    def ids_of(documents):
        return (torch.zeros(len(positions), dtype=torch.long) if documents is None
                else documents.q_ids.reshape(-1))
    (starts, _), _ = prepare_fa_kwargs_from_position_ids(row)
    flash = torch.zeros(len(positions), dtype=torch.long)
    flash[starts[:-1].long()] = 1  # (flash_attention_2 starts its first at the least too)
    flash = flash.cumsum(0) - flash[0]
    torch.testing.assert_close(ids_of(ak_hf._documents_from_positions(row)), flash)
    own = masking_utils.find_packed_sequence_indices(row)
    torch.testing.assert_close(ids_of(ak_hf._documents_from_positions(row, restarts=False)),
                               torch.zeros(len(positions), dtype=torch.long) if own is None
                               else own.reshape(-1))


def test_a_hybrid_model_whose_mask_counts_no_keys_generates():
    """MiniMax's cache sizes the decoding mask from its first layer, a linear-attention one
    without keys (1 key where the attention layer has them all): a mask that holds every key
    and pads nothing fits any key count, so generate gives sdpa's tokens."""
    config = getattr(transformers, "MiniMaxConfig", None)
    if config is None:
        pytest.skip("this transformers has no MiniMax")
    config = config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100,
                    num_local_experts=2, num_experts_per_tok=1, block_size=4, pad_token_id=0,
                    layer_types=["linear_attention", "full_attention"], eos_token_id=2)
    models = _models(config)  # (float32: its experts' grouped products take no float64)
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    tokens = {impl: m.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
              for impl, m in models.items()}
    assert torch.equal(tokens["attnkit"], tokens["sdpa"])


def test_a_mask_for_other_key_counts_is_refused_where_it_pads():
    """The free pass is for a mask that holds every key and pads nothing: a padded one of
    another key count that no 2-D padding mask of this layer's key count remakes is refused,
    naming both counts."""
    q, k, v = _rand(3, 1, 4, 1, 8).unbind(0)
    k, v = _rand(2, 1, 2, 7, 8, seed=1).unbind(0)
    module = torch.nn.Module()
    free = ak_hf.TransformersMask(None, 1, 1, 1)
    out, _ = ak_hf.attention_forward(module, q, k, v, free, scaling=0.5)
    torch.testing.assert_close(out, ak.attention(q, k, v, scale=0.5).transpose(1, 2))
    padded = ak_hf.TransformersMask(None, 1, 1, 1, padded=True)
    with pytest.raises(ValueError, match="1 queries × 1 keys but attends 1 queries × 7 keys"):
        ak_hf.attention_forward(module, q, k, v, padded, scaling=0.5)


def test_a_model_that_adds_its_bias_to_no_mask_runs():
    """BEiT adds its relative position bias to the mask transformers built, which is ``None``
    for sdpa without padding (``allow_is_bidirectional_skip``): the attnkit mask function
    gives ``None`` there too, and the bias arrives as a 4-D float mask."""
    config = transformers.BeitConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, image_size=16, patch_size=4,
                                     use_relative_position_bias=True, initializer_range=0.2)
    models = _models(config, auto=transformers.AutoModel, dtype=F64)
    pixels = _rand(2, 3, 16, 16, seed=3)
    with torch.no_grad():
        hidden = {impl: m(pixel_values=pixels).last_hidden_state for impl, m in models.items()}
    real = torch.ones(hidden["eager"].shape[:-1], dtype=torch.bool)
    limit = _limit(hidden["eager"], hidden["sdpa"], real, hidden["eager"].shape[1])
    assert (hidden["attnkit"] - hidden["eager"]).abs().max() <= limit


def test_an_all_ones_mask_keeps_a_bidirectional_row_whole():
    """A bidirectional decoder (``config.is_causal=False``) given a 2-D mask of real tokens and
    positions that restart: the row is one sequence, as sdpa and eager read it (a row is
    read as packed only without a 2-D mask)."""
    config = transformers.LlamaConfig(**_common())
    config.is_causal = False
    models = _models(config, auto=transformers.AutoModel, dtype=F64)
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    given = dict(attention_mask=torch.ones(1, 6, dtype=torch.long),
                 position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))
    with torch.no_grad():
        hidden = {impl: m(input_ids=ids, **given).last_hidden_state
                  for impl, m in models.items()}
    real = torch.ones(1, 6, dtype=torch.bool)
    assert (hidden["attnkit"] - hidden["eager"]).abs().max() <= _limit(
        hidden["eager"], hidden["sdpa"], real, 6)


def test_position_bias_is_added_to_the_scaled_scores():
    q, k, v = _rand(3, 2, 4, 5, 8).unbind(0)
    bias = _rand(1, 4, 5, 5, seed=1)
    module = torch.nn.Module()
    module.is_causal = False
    out, _ = ak_hf.attention_forward(module, q, k, v, None, scaling=1.0, position_bias=bias)
    expected = torch.softmax(q @ k.transpose(-1, -2) + bias, dim=-1) @ v
    torch.testing.assert_close(out, expected.transpose(1, 2))


# ---- the mask function against transformers' own dense masks ---------------------------------
def _pattern(kind: str, positions: torch.Tensor):
    if kind == "causal":
        return masking_utils.causal_mask_function
    if kind == "window":
        return masking_utils.sliding_window_causal_mask_function(4)
    if kind == "bidirectional":
        return masking_utils.bidirectional_mask_function
    if kind == "bidirectional-window":
        return masking_utils.sliding_window_bidirectional_mask_function(2)
    if kind == "chunked":
        return masking_utils.chunked_causal_mask_function(3, torch.tensor([0, 2]))
    if kind in ("packed", "packed-window"):
        base = _pattern("causal" if kind == "packed" else "window", positions)
        ids = masking_utils.find_packed_sequence_indices(positions)
        return masking_utils.and_masks(
            masking_utils.remap_positions_for_packed_sequence(base, positions),
            masking_utils.packed_sequence_mask_function(ids))
    if kind == "custom":  # a model's own overlay: no structured translation
        return masking_utils.or_masks(masking_utils.causal_mask_function,
                                      lambda b, h, q, kv: kv == 0)
    raise ValueError(kind)


# (pattern, q_length, kv_length, q_offset, kv_offset), as transformers' caches size them
GEOMETRIES = [
    ("causal", 8, 8, 0, 0),  # prefill
    ("causal", 1, 9, 8, 0),  # decoding
    ("causal", 3, 11, 8, 0),  # several new tokens after a cache
    ("causal", 5, 16, 0, 0),  # static cache, prefill
    ("causal", 1, 16, 7, 0),  # static cache, decoding
    ("window", 9, 9, 0, 0),  # window inside the prompt
    ("window", 1, 4, 9, 6),  # sliding cache full (window - 1 keys kept), decoding
    ("window", 3, 6, 9, 6),  # sliding cache full, 3 new tokens
    ("window", 2, 4, 1, 0),  # static sliding cache not yet full
    ("bidirectional", 7, 7, 0, 0),
    ("bidirectional-window", 7, 7, 0, 0),
    ("chunked", 8, 8, 0, 0),
    ("chunked", 1, 10, 9, 0),
    ("packed", 9, 9, 0, 0),
    ("packed-window", 9, 9, 0, 0),
    ("custom", 6, 6, 0, 0),
]


# transformers detects packed sequences only without a padding mask
CASES = [(*geometry, padding) for geometry in GEOMETRIES
         for padding in ("none", "ones", "left", "right", "holes")
         if padding == "none" or not geometry[0].startswith("packed")]


@pytest.mark.parametrize("kind,q_len,kv_len,q_offset,kv_offset,padding", CASES)
def test_mask_function_equals_transformers_dense_mask(kind, q_len, kv_len, q_offset, kv_offset,
                                                     padding):
    batch, seen = 2, q_offset + q_len  # the 2-D mask covers every token seen so far
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], list(range(9))])
    attention_mask = None if padding == "none" else torch.ones(batch, seen, dtype=torch.bool)
    if padding == "left":
        attention_mask[1, :min(3, seen - 1)] = False
    elif padding == "right":
        attention_mask[1, max(1, seen - 3):] = False
    elif padding == "holes":
        attention_mask[1, ::2] = False
    pattern = _pattern(kind, positions)
    args = dict(batch_size=batch, q_length=q_len, kv_length=kv_len, q_offset=q_offset,
                kv_offset=kv_offset, mask_function=pattern, attention_mask=attention_mask)
    expected = masking_utils.sdpa_mask(**args, allow_is_causal_skip=False)  # [B, 1, Tq, Tk]
    result = ak_hf.mask_forward(**args)
    assert result.shape == (batch, 1, q_len, kv_len)
    assert result.structured == (kind != "custom")
    space = MaskSpace(batch=batch, heads=1, q_len=q_len, kv_len=kv_len)
    got = (torch.ones(1, 1, q_len, kv_len, dtype=torch.bool) if result.mask is None
           else result.mask.to_dense(space))
    assert torch.equal(got.expand(expected.shape), expected), (result, got.int(), expected.int())
    if result.structured and padding in ("left", "right"):
        leaves = _leaves(result.mask)
        assert not any(isinstance(leaf, DENSE) for leaf in leaves), result
    if not result.structured and padding == "left" and kv_offset == 0:
        # the dense fallback holds the padding too: the invariance contract's key blocks
        # start where each row's keys do
        assert key_starts(result.mask).tolist() == [0, min(3, seen - 1)], result
    if result.structured and padding == "ones" and seen >= kv_offset + kv_len:  # all real
        assert result.mask is None or not any(isinstance(leaf, PADDING)
                                              for leaf in _leaves(result.mask)), result
    # the last rows, as a model that keeps only them slices its mask (Gemma 4's shared KV)
    assert result[:, :, 0:, :] is result
    for rows in (slice(-1, None), slice(1, q_len - 1), slice(q_len // 2, None)):
        part = result[:, :, rows]
        want = expected[:, :, rows]
        assert part.shape == (batch, 1, want.shape[2], kv_len)
        space = MaskSpace(batch=batch, heads=1, q_len=want.shape[2], kv_len=kv_len)
        got = (torch.ones(1, 1, *want.shape[2:], dtype=torch.bool) if part.mask is None
               else part.mask.to_dense(space))
        assert torch.equal(got.expand(want.shape), want), (rows, part, got.int(), want.int())
    with pytest.raises(TypeError, match="attn_implementation='eager'"):
        result[:, 0]


def test_a_model_that_keeps_its_last_query_rows_matches_sdpa():
    """Gemma 4 with shared-KV layers runs them on the last ``logits_to_keep`` rows only,
    slicing each layer type's mask: logits and generated tokens as on sdpa."""
    config = getattr(transformers, "Gemma4TextConfig", None)
    if config is None:
        pytest.skip("this transformers has no Gemma 4")
    config = config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    global_head_dim=32, sliding_window=4, vocab_size_per_layer_input=128,
                    hidden_size_per_layer_input=8, num_kv_shared_layers=2,
                    layer_types=["sliding_attention", "full_attention"] * 2)
    models = _models(config)
    ours, theirs = models["attnkit"], models["sdpa"]
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [3, 4, 5, 6, 7, 8, 9]])
    mask = torch.tensor([[1] * 7, [0, 0] + [1] * 5])
    with torch.no_grad():
        for keep in (0, 1, 3):
            got = ours(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits
            want = theirs(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits
            torch.testing.assert_close(got, want)
        generated = [m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,
                                do_sample=False, pad_token_id=0) for m in (ours, theirs)]
    assert torch.equal(*generated)


@pytest.mark.parametrize("config", [
    lambda: transformers.FalconConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      vocab_size=100, alibi=True),
    lambda: transformers.BloomConfig(hidden_size=32, n_layer=1, n_head=4, vocab_size=100),
    lambda: transformers.XGLMConfig(d_model=32, num_layers=1, attention_heads=4, ffn_dim=64,
                                    vocab_size=100),
], ids=["falcon-alibi", "bloom", "xglm"])
def test_a_model_that_adds_to_its_mask_tensor_is_told_why_it_cannot_run(config):
    """Falcon with ALiBi and BLOOM add their ALiBi bias to the attention mask themselves,
    as a tensor, and XGLM computes attention itself: the error names that and the
    implementation that can run them."""
    model = transformers.AutoModelForCausalLM.from_config(config(), attn_implementation="attnkit")
    ids, mask = torch.randint(3, 100, (2, 6)), torch.tensor([[1] * 6, [0, 0] + [1] * 4])
    with pytest.raises((TypeError, AttributeError), match="attn_implementation='eager'"):
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)


def test_packed_documents_are_shared_per_thread():
    """The layers of a forward pass share the documents of its position_ids, per thread: a
    pass on another thread neither reads nor replaces them."""
    import threading

    made = []

    def make(tag):
        return lambda: made.append(tag) or tag
    mine, theirs = (torch.tensor([[0, 1, 0, 1]]),), (torch.tensor([[0, 0, 1, 2]]),)
    assert ak_hf._shared_documents(mine, make("mine")) == "mine"
    assert ak_hf._shared_documents(mine, make("again")) == "mine"  # kept for this pass

    def other():
        assert ak_hf._shared_documents(mine, make("other thread")) == "other thread"
        assert ak_hf._shared_documents(theirs, make("theirs")) == "theirs"
    worker = threading.Thread(target=other)
    worker.start()
    worker.join()
    assert ak_hf._shared_documents(mine, make("after")) == "mine"
    assert made == ["mine", "other thread", "theirs"]
