"""``attn_implementation="attnkit"`` under transformers' generation strategies, cache classes
and training utilities, against ``"sdpa"`` (``"eager"`` where a model has no sdpa: Gemma 2).

Each model is tiny (2 layers, hidden 64, float32, dropout 0) and built for every
implementation on the same weights, drawn from a seeded generator. Prompts are left-padded
batches of very different lengths (1, 40 and 7 tokens). Generated tokens must be equal and
logits close (``1e-5`` relative to the reference's largest logit of each step); losses and
parameter gradients of a training step within ``1e-5`` relative to the reference's largest
value (float32 rounding); under ``torch.autocast(dtype=bfloat16)``, as close to the float32
step as the reference's autocast step is.

Sampling (``do_sample=True``) draws from a ``torch.Generator`` through a logits processor:
the argmax of ``logits + Gumbel noise`` is a sample of ``softmax(logits)``, and the processor
leaves only that token finite, so transformers' multinomial draw (from the global RNG, kept
unchanged by ``fork_rng``) can only return it. A model class this transformers lacks is
skipped.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnkit.integrations.transformers as ak_hf  # noqa: E402

RTOL = 1e-5  # float32 rounding, relative to the reference's largest value
LENGTHS = (1, 40, 7)  # the prompts of one left-padded batch
WINDOW = 8


@pytest.fixture(scope="module", autouse=True)
def registered():
    ak_hf.register()


def _lm(**extra) -> dict:
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=100, max_position_embeddings=128,
                pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)


def _config(name: str, **fields):
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"this transformers has no {name}")
    return cls(**fields)


CONFIGS = {
    "llama": lambda: _config("LlamaConfig", **_lm()),
    # a window of 8 keys: the 40-token prompt and the decoding steps cross it
    "mistral": lambda: _config("MistralConfig", **_lm(sliding_window=WINDOW)),
    "qwen2": lambda: _config("Qwen2Config", **_lm(
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "gemma2": lambda: _config("Gemma2Config", **_lm(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        attn_logit_softcapping=50.0)),
    "gemma3": lambda: _config("Gemma3TextConfig", **_lm(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"])),
    "bart": lambda: _config(
        "BartConfig", d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128, encoder_layers=2,
        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, vocab_size=100,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=2, forced_eos_token_id=None),
    "t5": lambda: _config(
        "T5Config", d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4, vocab_size=100,
        pad_token_id=0, eos_token_id=2, decoder_start_token_id=0),
    "bert": lambda: _config(
        "BertConfig", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, vocab_size=100, max_position_embeddings=128, pad_token_id=0),
}
AUTO = {"bart": "AutoModelForSeq2SeqLM", "t5": "AutoModelForSeq2SeqLM",
        "bert": "AutoModelForMaskedLM"}
DECODERS = ["llama", "mistral", "qwen2", "gemma2", "gemma3"]


def _no_dropout(config):
    for field, value in config.to_dict().items():
        if isinstance(value, float) and "drop" in field:
            setattr(config, field, 0.0)
    return config


def _models(name: str, layers: int = 2) -> dict:
    """``{"reference": model, "attnkit": model}`` on the same weights (``sdpa``, or ``eager``
    for a model without sdpa), float32, eval mode. Weights are drawn from a seeded generator:
    matrices ``N(0, 0.2²)`` (attention far from uniform, so a wrong mask changes outputs by
    O(1)), vectors (norms, biases) their initial value ``+ N(0, 0.1²)``."""
    config = _no_dropout(CONFIGS[name]())
    for field in ("num_hidden_layers", "encoder_layers", "decoder_layers", "num_layers"):
        if hasattr(config, field):
            setattr(config, field, layers)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:layers]
    auto = getattr(transformers, AUTO.get(name, "AutoModelForCausalLM"))
    models = {}
    for role, impl in (("reference", "sdpa"), ("attnkit", "attnkit")):
        with torch.random.fork_rng():  # from_config draws an initialisation we overwrite
            try:
                models[role] = auto.from_config(copy.deepcopy(config), attn_implementation=impl)
            except ValueError:  # this model has no sdpa: eager is the reference
                models[role] = auto.from_config(copy.deepcopy(config),
                                                attn_implementation="eager")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in models["reference"].parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(noise * 0.2 if param.dim() > 1 else param + noise * 0.1)
    models["attnkit"].load_state_dict(models["reference"].state_dict())
    return {role: model.eval() for role, model in models.items()}


def _batch(lengths=LENGTHS, seed: int = 1, side: str = "left"):
    """Token ids and ``attention_mask [len(lengths), max(lengths)]``, padded on ``side``."""
    width = max(lengths)
    ids = torch.randint(3, 100, (len(lengths), width),
                        generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, width - length:] = 1
    if side == "right":
        ids, mask = ids.flip(1), mask.flip(1)
    return ids.masked_fill(mask == 0, 0), mask


def _close(mine: torch.Tensor, reference: torch.Tensor, rtol: float, what: str) -> None:
    assert mine.shape == reference.shape, what
    limit = rtol * reference.abs().max().item()
    assert (mine - reference).abs().max().item() <= limit, what


def _generate(models: dict, ids, mask, processors=None, **options) -> dict:
    """Each model's ``generate`` (``return_dict_in_generate``, with logits); ``processors``:
    a factory of a fresh ``LogitsProcessorList`` per model."""
    out = {}
    for role, model in models.items():
        extra = {} if processors is None else {"logits_processor": processors()}
        out[role] = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=0,
                                   return_dict_in_generate=True, output_logits=True,
                                   **extra, **options)
    return out


def _same_generation(out: dict) -> None:
    """Equal tokens and close logits of every step (the model's own, before any processor)."""
    mine, reference = out["attnkit"], out["reference"]
    assert torch.equal(mine.sequences, reference.sequences)
    assert len(mine.logits) == len(reference.logits)
    for step, (a, b) in enumerate(zip(mine.logits, reference.logits)):
        _close(a, b, RTOL, f"logits of step {step}")


class _Gumbel(transformers.LogitsProcessor):
    """Samples ``softmax(scores)`` with its own seeded generator (the argmax of ``scores``
    plus Gumbel noise) and leaves only the sampled token finite."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, input_ids, scores):
        uniform = torch.rand(scores.shape, generator=self.generator).clamp_min(1e-20)
        chosen = (scores - torch.log(-torch.log(uniform))).argmax(-1, keepdim=True)
        return torch.full_like(scores, -torch.inf).scatter(-1, chosen, 0.0)


# ---- generation strategies -------------------------------------------------------------------
STRATEGIES = {
    "beam": dict(num_beams=3, min_new_tokens=10),
    "beam-early-stopping": dict(num_beams=3, early_stopping=True),
    "beam-3-returned": dict(num_beams=3, num_return_sequences=3, min_new_tokens=10),
    "sample-2-returned": dict(do_sample=True, num_return_sequences=2, min_new_tokens=10),
    "static-cache": dict(cache_implementation="static", min_new_tokens=10),
    "beam-static-cache": dict(num_beams=3, cache_implementation="static", min_new_tokens=10),
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("name", ["mistral", "gemma3", "bart"])
def test_generation_strategies_match_reference(name, strategy):
    """10 new tokens after prompts of 1, 40 and 7 tokens (left-padded; windows of 8)."""
    models = _models(name)
    ids, mask = _batch()
    sampling = strategy.startswith("sample")
    processors = (lambda: transformers.LogitsProcessorList(
        [transformers.TopKLogitsWarper(20), _Gumbel(5)])) if sampling else None
    options = {"do_sample": False, **STRATEGIES[strategy]}
    with torch.random.fork_rng():
        out = _generate(models, ids, mask, processors, max_new_tokens=10, **options)
    _same_generation(out)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2", "t5"])
def test_beam_search_matches_reference(name):
    models = _models(name)
    ids, mask = _batch()
    _same_generation(_generate(models, ids, mask, do_sample=False, num_beams=3,
                               num_return_sequences=2, max_new_tokens=8, min_new_tokens=8))


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_decoding_past_the_window_matches_reference(name):
    """30 new tokens after a 40-token prompt, with the dynamic and the static cache: both keep
    only the window of the sliding layers."""
    models = _models(name)
    ids, mask = _batch()
    for cache in ("dynamic", "static"):
        _same_generation(_generate(models, ids, mask, do_sample=False, max_new_tokens=30,
                                   min_new_tokens=30, cache_implementation=cache))


@pytest.mark.parametrize("name", ["mistral", "bart"])
def test_assisted_decoding_matches_reference(name):
    """A one-layer copy as the assistant (batch 1, as transformers requires), and prompt
    lookup decoding."""
    models, assistants = _models(name), _models(name, layers=1)
    ids, mask = _batch((40,))
    tokens = {role: model.generate(input_ids=ids, attention_mask=mask, pad_token_id=0,
                                   assistant_model=assistants[role], do_sample=False,
                                   max_new_tokens=12, min_new_tokens=12)
              for role, model in models.items()}
    assert torch.equal(tokens["attnkit"], tokens["reference"])
    lookup = {role: model.generate(input_ids=ids, attention_mask=mask, pad_token_id=0,
                                   prompt_lookup_num_tokens=3, do_sample=False,
                                   max_new_tokens=12, min_new_tokens=12)
              for role, model in models.items()}
    assert torch.equal(lookup["attnkit"], lookup["reference"])


# ---- caches ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_generation_continues_from_returned_cache(name):
    """``generate`` again on the first call's ``past_key_values`` with 2 more prompt tokens."""
    models = _models(name)
    ids, mask = _batch()
    out = {}
    for role, model in models.items():
        first = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=0,
                               do_sample=False, max_new_tokens=5, min_new_tokens=5,
                               return_dict_in_generate=True)
        more = torch.full((ids.shape[0], 2), 17)
        out[role] = model.generate(
            input_ids=torch.cat([first.sequences, more], 1),
            attention_mask=torch.cat([mask, torch.ones(ids.shape[0], 7, dtype=mask.dtype)], 1),
            past_key_values=first.past_key_values, pad_token_id=0, do_sample=False,
            max_new_tokens=8, min_new_tokens=8, return_dict_in_generate=True, output_logits=True)
    _same_generation(out)


@pytest.mark.parametrize("cache", ["DynamicCache", "StaticCache"])
@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_chunked_prefill_with_a_cache_matches_reference(name, cache):
    """The forward pass fed in chunks of 40, 3, 12, 1 and 14 tokens (some longer than the
    window of 8) through an explicit cache object; logits of the real tokens."""
    cls = getattr(transformers, cache, None)
    if cls is None:
        pytest.skip(f"this transformers has no {cache}")
    models = _models(name)
    ids, mask = _batch()
    extra = torch.randint(3, 100, (ids.shape[0], 30), generator=torch.Generator().manual_seed(9))
    ids = torch.cat([ids, extra], 1)
    mask = torch.cat([mask, torch.ones_like(extra)], 1)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    logits = {}
    for role, model in models.items():
        past = (cls(config=model.config) if cache == "DynamicCache"
                else cls(config=model.config, max_cache_len=80))
        chunks, start = [], 0
        with torch.no_grad():
            for size in (40, 3, 12, 1, 14):
                end = start + size
                out = model(input_ids=ids[:, start:end], attention_mask=mask[:, :end],
                            position_ids=positions[:, start:end], past_key_values=past,
                            cache_position=torch.arange(start, end), use_cache=True)
                chunks.append(out.logits)
                past, start = out.past_key_values, end
        logits[role] = torch.cat(chunks, 1)[mask.bool()]
    _close(logits["attnkit"], logits["reference"], RTOL, "logits")


@pytest.mark.parametrize("name", ["llama", "gemma3", "bart", "bert"])
def test_forward_without_cache_matches_reference(name):
    models = _models(name)
    ids, mask = _batch(side="right" if name == "bert" else "left")
    inputs = dict(input_ids=ids, attention_mask=mask)
    if name != "bert":
        inputs["use_cache"] = False
    if name == "bart":
        inputs["decoder_input_ids"] = ids[:, :6].clamp_min(3)
    with torch.no_grad():
        logits = {role: model(**inputs).logits for role, model in models.items()}
    real = mask.bool() if name != "bart" else torch.ones(ids.shape[0], 6, dtype=torch.bool)
    _close(logits["attnkit"][real], logits["reference"][real], RTOL, "logits")


# ---- training --------------------------------------------------------------------------------
def _training_step(model, ids, mask, seq2seq: bool, autocast: bool):
    """Logits of the real tokens (float32), loss and every parameter's gradient of one step
    with labels (padding ignored)."""
    model.train()
    labels = ids.masked_fill(mask == 0, -100)
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    if seq2seq:
        inputs["labels"] = labels[:, -10:].contiguous()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(**inputs)
    out.loss.backward()
    logits = out.logits.detach().float()
    return (logits if seq2seq else logits[mask.bool()], out.loss.detach(),
            {n: p.grad for n, p in model.named_parameters() if p.grad is not None})


def _same_training(models: dict, ids, mask, seq2seq: bool) -> None:
    steps = {role: _training_step(model, ids, mask, seq2seq, autocast=False)
             for role, model in models.items()}
    (_, loss, grads), (_, ref_loss, ref_grads) = steps["attnkit"], steps["reference"]
    _close(loss, ref_loss, RTOL, "loss")
    assert grads.keys() == ref_grads.keys()
    for param, ref in ref_grads.items():
        if not param.endswith(("k_proj.bias", "key.bias")):  # softmax ignores it: grad ~0
            _close(grads[param], ref, RTOL, param)


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("name", ["llama", "gemma3", "bart"])
def test_gradient_checkpointing_matches_reference(name, reentrant):
    """A left-padded batch with labels (the row of one token included) under
    ``gradient_checkpointing_enable``: loss and every parameter's gradient."""
    models = _models(name)
    for model in models.values():
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids, mask = _batch()
    _same_training(models, ids, mask, seq2seq=name == "bart")


@pytest.mark.parametrize("name", ["llama", "gemma2", "bert"])
def test_bfloat16_autocast_training_step_is_as_close_as_reference(name):
    """A step under ``torch.autocast("cpu", dtype=torch.bfloat16)``: its logits and each
    parameter's gradient differ from the reference's float32 step (Frobenius norm) by at most
    twice what the reference's own autocast step differs, plus float32 rounding. Both round
    to bfloat16 in other places (eager, Gemma 2's reference, rounds its softcapped scores),
    so their errors differ by chance; the loss, one sum of them, is not compared."""
    models = _models(name)
    ids, mask = _batch(side="right")
    exact = _training_step(copy.deepcopy(models["reference"]), ids, mask, False, autocast=False)
    mine, ref = (_training_step(models[role], ids, mask, False, autocast=True)
                 for role in ("attnkit", "reference"))

    def check(a, b, truth, what):
        bound = 2 * (b - truth).norm().item() + RTOL * truth.norm().item()
        assert (a - truth).norm().item() <= bound, what

    check(mine[0], ref[0], exact[0], "logits")
    assert mine[2].keys() == exact[2].keys()
    for param, truth in exact[2].items():
        if not param.endswith(("k_proj.bias", "key.bias")):  # softmax ignores it: grad ~0
            check(mine[2][param], ref[2][param], truth, param)


# ---- attention weights -----------------------------------------------------------------------
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["mistral", "bart"])
def test_generate_returns_the_attention_weights_of_eager(name, cache):
    """``output_attentions=True`` in ``generate``: every step's weights (prompt: the real
    query rows), as eager returns them."""
    models = _models(name)
    eager = copy.deepcopy(models["reference"])
    eager.set_attn_implementation("eager")
    ids, mask = _batch()
    out = {}
    for role, model in (("eager", eager), ("attnkit", models["attnkit"])):
        out[role] = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=0,
                                   do_sample=False, max_new_tokens=4, min_new_tokens=4,
                                   cache_implementation=cache, return_dict_in_generate=True,
                                   output_attentions=True)
    assert torch.equal(out["attnkit"].sequences, out["eager"].sequences)
    fields = ("decoder_attentions", "cross_attentions") if name == "bart" else ("attentions",)
    compared = 0
    for field in fields:
        for step, (mine, ref) in enumerate(zip(getattr(out["attnkit"], field),
                                               getattr(out["eager"], field))):
            assert len(mine) == len(ref) > 0, field
            for a, b in zip(mine, ref):
                assert a is not None and a.shape == b.shape, field
                rows = mask.bool() if field == "attentions" and step == 0 else None
                diff = (a - b).transpose(1, 2)  # [B, Tq, H, Tk]
                diff = diff if rows is None else diff[rows]
                assert diff.abs().max().item() <= RTOL, f"{field} of step {step}"
                compared += 1
    assert compared >= 8
